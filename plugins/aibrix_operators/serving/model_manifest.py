"""The model manifest: every file of a model with its size and sha256, and the checks on it.

A manifest is what the model fetcher (``model_fetch.py``) trusts: it downloads exactly the
files listed here, to exactly these relative paths, and accepts a file only when its bytes
hash to the digest written here. So each path is checked before anything is written
(relative, ``/``-separated, no ``..`` or ``.`` component, no control characters, not inside
the fetcher's own state folder), and the manifest as a whole is refused if two entries
would land on one file or a file would be another one's folder.

Format (``model-manifest.json``, stored beside the weights or given by the deployment)::

    {"format": "aibrix-model-manifest/1",
     "files": [{"path": "config.json", "size": 642, "sha256": "<64 hex>"}, ...]}

``python -m aibrix_operators.serving.model_manifest DIR`` writes ``DIR/model-manifest.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMAT = "aibrix-model-manifest/1"
MANIFEST_NAME = "model-manifest.json"
# The fetcher's journal and partial files live here, inside the destination.
STATE_DIR = ".model-fetch"
# A manifest is a list of file names: anything larger is not one.
MAX_MANIFEST_BYTES = 16 * 1024 * 1024
MAX_PATH_CHARS = 1024
_HEX64 = re.compile(r"[0-9a-f]{64}")
_HASH_BLOCK = 8 * 1024 * 1024


class ManifestError(ValueError):
    """The manifest is unusable; the message names the entry and what is wrong with it."""


@dataclass(frozen=True)
class ManifestFile:
    path: str  # relative, "/"-separated, checked by check_relative_path
    size: int
    sha256: str  # lowercase hex


def check_relative_path(path: Any) -> str:
    """``path`` if it names a file strictly inside the destination, else ManifestError.

    Checked as text, before any filesystem call, so the answer does not depend on what is
    on disk; the fetcher also checks the resolved path (a symlink already in the destination).
    """
    if not isinstance(path, str) or not path:
        raise ManifestError(f"manifest path {path!r}: must be a non-empty string")
    if len(path) > MAX_PATH_CHARS:
        raise ManifestError(f"manifest path {path[:60]!r}...: longer than {MAX_PATH_CHARS} characters")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in path):
        raise ManifestError(f"manifest path {path!r}: control characters are not allowed")
    if path.startswith("/") or "\\" in path or re.match(r"[A-Za-z]:", path):
        raise ManifestError(f"manifest path {path!r}: must be relative, with / between folders")
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise ManifestError(f"manifest path {path!r}: empty, '.' and '..' components are not allowed")
    if parts[0] == STATE_DIR:
        raise ManifestError(f"manifest path {path!r}: {STATE_DIR}/ is the fetcher's own folder")
    return path


def parse_manifest(data: bytes, where: str) -> list[ManifestFile]:
    """The manifest's files, every entry checked; ``where`` names the manifest in errors."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{where}: over {MAX_MANIFEST_BYTES} bytes, not a model manifest")
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"{where}: not JSON ({exc})") from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("files"), list):
        raise ManifestError(f"{where}: not a {FORMAT} manifest (want format and files keys)")
    files: list[ManifestFile] = []
    for i, entry in enumerate(doc["files"]):
        if not isinstance(entry, dict) or set(entry) != {"path", "size", "sha256"}:
            raise ManifestError(f"{where}: files[{i}] must have exactly path, size and sha256")
        path = check_relative_path(entry["path"])
        size, digest = entry["size"], entry["sha256"]
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ManifestError(f"{where}: {path}: size {size!r} is not a byte count")
        if not isinstance(digest, str) or not _HEX64.fullmatch(digest):
            raise ManifestError(f"{where}: {path}: sha256 {digest!r} is not 64 lowercase hex digits")
        files.append(ManifestFile(path, size, digest))
    if not files:
        raise ManifestError(f"{where}: lists no files")
    _check_no_overlap(files, where)
    return files


def _check_no_overlap(files: list[ManifestFile], where: str) -> None:
    # Case-folded too: on a case-insensitive filesystem two such names are one file.
    seen: set[str] = set()
    for f in files:
        if f.path.casefold() in seen:
            raise ManifestError(f"{where}: {f.path} is listed twice")
        seen.add(f.path.casefold())
    folders = {
        "/".join(f.path.split("/")[:n]).casefold() for f in files for n in range(1, f.path.count("/") + 1)
    }
    for f in files:
        if f.path.casefold() in folders:
            raise ManifestError(f"{where}: {f.path} is both a file and another file's folder")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as fh:
        while block := fh.read(_HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def make_manifest(model_dir: Path) -> dict[str, Any]:
    """The manifest of every regular file under ``model_dir`` (symlinks followed: a Hugging
    Face snapshot is links into its blob store), less the manifest and fetch state."""
    root = Path(model_dir)
    if not root.is_dir():
        raise ManifestError(f"{root}: not a directory")
    files = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if rel == MANIFEST_NAME or rel.split("/")[0] == STATE_DIR or not path.is_file():
            continue
        files.append(
            {"path": check_relative_path(rel), "size": path.stat().st_size, "sha256": sha256_file(path)}
        )
    doc = {"format": FORMAT, "files": files}
    parse_manifest(json.dumps(doc).encode(), str(root))  # what the fetcher will accept
    return doc


def write_manifest(model_dir: Path, out: Path | None = None) -> Path:
    target = out or Path(model_dir) / MANIFEST_NAME
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(json.dumps(make_manifest(model_dir), indent=1) + "\n")
    os.replace(tmp, target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m aibrix_operators.serving.model_manifest",
        description="Write the sha256 manifest of a model directory (upload it beside the weights).",
    )
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("-o", "--output", type=Path, help=f"default: MODEL_DIR/{MANIFEST_NAME}")
    args = parser.parse_args(argv)
    try:
        print(write_manifest(args.model_dir, args.output))
    except (ManifestError, OSError) as exc:
        print(f"model_manifest: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
