"""Render an eval report in headless Chromium and save a PNG screenshot.

    .venv/bin/python scripts/screenshot_report.py REPORT.html OUT.png [--width 1000 --height 1300]

Used for docs/eval-report.png and by tests/evaluation/test_report_browser.py. Chromium runs with a
fresh profile, no sandbox (containers), no GPU, no network features.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
from pathlib import Path


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    raise FileNotFoundError("no chromium on PATH: apt-get install -y chromium")


def screenshot(html: Path, out: Path, width: int = 1000, height: int = 1300, timeout_s: float = 90) -> None:
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(
            [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--no-first-run", f"--user-data-dir={profile}",
             "--hide-scrollbars", f"--window-size={width},{height}", f"--screenshot={out.resolve()}",
             html.resolve().as_uri()],
            check=True, capture_output=True, timeout=timeout_s,
        )
    if not out.exists():
        raise RuntimeError(f"chromium wrote no screenshot to {out}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("html", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--width", type=int, default=1000)
    parser.add_argument("--height", type=int, default=1300)
    args = parser.parse_args(argv)
    screenshot(args.html, args.out, args.width, args.height)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
