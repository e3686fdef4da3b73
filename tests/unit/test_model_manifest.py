"""The model manifest: what make_manifest writes, and every path and entry parse_manifest refuses."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from aibrix_operators.serving.model_manifest import (
    FORMAT,
    MANIFEST_NAME,
    STATE_DIR,
    ManifestError,
    check_relative_path,
    main,
    make_manifest,
    parse_manifest,
)

DIGEST = "a" * 64


def doc(*files: dict) -> bytes:
    return json.dumps({"format": FORMAT, "files": list(files)}).encode()


def entry(path: str, size: int = 1, sha256: str = DIGEST) -> dict:
    return {"path": path, "size": size, "sha256": sha256}


def test_make_manifest_lists_every_file_with_size_and_digest(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "config.json").write_bytes(b"{}")
    (tmp_path / "sub" / "w.bin").write_bytes(os.urandom(1000))
    (tmp_path / "blob").write_bytes(b"linked")
    (tmp_path / "link.bin").symlink_to(tmp_path / "blob")  # a Hugging Face snapshot's layout
    (tmp_path / STATE_DIR).mkdir()
    (tmp_path / STATE_DIR / "verified.jsonl").write_bytes(b"x")  # the fetcher's, never listed
    assert main([str(tmp_path)]) == 0
    written = json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert written == make_manifest(tmp_path)  # the manifest does not list itself
    got = {f["path"]: (f["size"], f["sha256"]) for f in written["files"]}
    assert got == {
        p: (len(b), hashlib.sha256(b).hexdigest())
        for p, b in {
            "blob": b"linked",
            "config.json": b"{}",
            "link.bin": b"linked",
            "sub/w.bin": (tmp_path / "sub" / "w.bin").read_bytes(),
        }.items()
    }
    assert [f.path for f in parse_manifest((tmp_path / MANIFEST_NAME).read_bytes(), "m")] == sorted(got)


@pytest.mark.parametrize("path", [
    "../x", "a/../../x", "a/..", "..", "/etc/passwd", "//x", "a//b", "./a", "a/./b", "a/", "",
    "a\\..\\x", "C:x", "a\nb", "a\x00b", f"{STATE_DIR}/verified.jsonl", "x" * 1025,
])  # fmt: skip
def test_paths_that_could_land_outside_dest_or_on_the_fetchers_state_are_refused(path: str) -> None:
    with pytest.raises(ManifestError, match="manifest path"):
        check_relative_path(path)
    with pytest.raises(ManifestError):
        parse_manifest(doc(entry("ok.bin"), entry(path)), "m")


@pytest.mark.parametrize("path", ["config.json", "a/b/c.safetensors", "..a", "a..b/c", ".hidden", "a b"])
def test_ordinary_relative_paths_pass(path: str) -> None:
    assert check_relative_path(path) == path


@pytest.mark.parametrize(("files", "message"), [
    ([entry("a"), entry("a")], "listed twice"),
    ([entry("A.bin"), entry("a.bin")], "listed twice"),  # one file on a case-insensitive disk
    ([entry("a"), entry("a/b")], "both a file and another file's folder"),
    ([entry("a", size=-1)], "not a byte count"),
    ([entry("a", size=True)], "not a byte count"),
    ([entry("a", sha256="A" * 64)], "64 lowercase hex"),
    ([entry("a", sha256="a" * 63)], "64 lowercase hex"),
    ([{**entry("a"), "mode": 0o777}], "exactly path, size and sha256"),
    ([], "lists no files"),
])  # fmt: skip
def test_inconsistent_manifests_are_refused(files: list[dict], message: str) -> None:
    with pytest.raises(ManifestError, match=message):
        parse_manifest(doc(*files), "m")


@pytest.mark.parametrize(
    "data", [b"not json", b"[]", b'{"files": []}', json.dumps({"format": "v0", "files": []}).encode()]
)
def test_other_documents_are_not_manifests(data: bytes) -> None:
    with pytest.raises(ManifestError, match="^m: "):
        parse_manifest(data, "m")
