"""The report as a browser shows it: headless Chromium renders report.html (no network: the
trend plot is inline); the screenshot holds the verdict badge's colour and the plot's line."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from tests.evaluation.test_regression import _night, _suite, addition_dataset

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

from screenshot_report import screenshot  # noqa: E402

pytestmark = pytest.mark.e2e


def _has_colour(img: np.ndarray, rgb: tuple[int, int, int], tol: int = 6, min_pixels: int = 50) -> bool:
    px = (img[..., :3] * 255).round().astype(int)
    close = np.all(np.abs(px - np.array(rgb)) <= tol, axis=-1)
    return int(close.sum()) >= min_pixels


def test_report_renders_in_chromium(tmp_path):
    import matplotlib.image

    suite = _suite(addition_dataset(tmp_path))
    for date, right in (("2026-11-01", 92), ("2026-11-02", 91), ("2026-11-03", 55)):
        night = _night(tmp_path, suite, date, right=right)
    shot = tmp_path / "report.png"
    screenshot(night["prefix"] / "report.html", shot)
    img = matplotlib.image.imread(shot)
    assert img.shape[0] == 1300 and img.shape[1] == 1000
    assert _has_colour(img, (0xF7, 0xC6, 0xC6))  # the REGRESSION badge / regressed rows
    assert _has_colour(img, (0x1F, 0x77, 0xB4), tol=12)  # matplotlib's tab:blue score line: the PNG decoded
