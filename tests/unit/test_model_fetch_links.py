"""The model fetcher never follows a symbolic link planted under its destination (security review
finding 3): on a real file system, a link where the fetcher keeps its state (``.model-fetch``,
its ``parts/``, its journal), where a folder of a manifest path or the destination itself must
be, fails the fetch naming the link, with nothing deleted or written where it points. The store
is a stub in memory; everything on disk is real."""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path
from typing import Any

import pytest

from aibrix_operators.serving.model_fetch import EXIT_USAGE, JOURNAL, FetchError, FetchOptions, ModelFetcher
from aibrix_operators.serving.model_manifest import STATE_DIR, ManifestFile

CONTENT = {"config.json": b'{"r": 8}\n', "sub/adapter_model.safetensors": os.urandom(5000)}
FILES = [ManifestFile(p, len(b), hashlib.sha256(b).hexdigest()) for p, b in CONTENT.items()]


class Store:
    """Answers ranged GETs like S3 for ``CONTENT`` under s3://b/m/."""

    def __init__(self) -> None:
        self.gets: list[str] = []

    def get_object(self, Bucket: str, Key: str, Range: str | None = None) -> dict[str, Any]:  # noqa: N803
        self.gets.append(Key)
        data = CONTENT[Key.removeprefix("m/")]
        if Range is None:
            return {"ContentLength": len(data), "Body": io.BytesIO(data)}
        start, _, end = Range.removeprefix("bytes=").partition("-")
        part = data[int(start) : int(end) + 1]
        return {"ContentLength": len(part), "ContentRange": f"bytes {start}-{end}/{len(data)}",
                "Body": io.BytesIO(part)}  # fmt: skip


def fetch(dest: Path, store: Any = None, reverify: bool = False) -> ModelFetcher:
    options = FetchOptions(workers=2, chunk_bytes=1024, reverify=reverify)
    fetcher = ModelFetcher("s3://b/m", dest, FILES, store or Store(), options)
    fetcher.run()
    return fetcher


@pytest.fixture()
def outside(tmp_path: Path) -> Path:
    """A folder the fetch must not touch: what a planted link points to."""
    victim = tmp_path / "outside"
    (victim / "parts").mkdir(parents=True)
    (victim / "parts" / "precious.bin").write_bytes(b"not the fetcher's")
    (victim / JOURNAL).write_bytes(b"someone else's log\n")
    (victim / "0.part").write_bytes(b"someone else's file")
    return victim


def snapshot(root: Path) -> dict[str, bytes | str]:
    def what(p: Path) -> bytes | str:
        return os.readlink(p) if p.is_symlink() else p.read_bytes() if p.is_file() else "dir"

    return {p.relative_to(root).as_posix(): what(p) for p in sorted(root.rglob("*"))}


def refused(dest: Path, link: Path, store: Any = None) -> str:
    with pytest.raises(FetchError) as info:
        fetch(dest, store)
    assert info.value.exit_code == EXIT_USAGE
    message = str(info.value)
    assert message.startswith(f"{link}: is a symbolic link (to ") and "remove the link" in message, message
    return message


@pytest.mark.parametrize("planted", [STATE_DIR, f"{STATE_DIR}/parts"])
def test_a_planted_state_folder_link_is_refused_and_nothing_is_deleted_through_it(
    tmp_path: Path, outside: Path, planted: str
) -> None:
    dest = tmp_path / "cache" / "adapter" / "v1"
    (dest / STATE_DIR).mkdir(parents=True)
    if planted == STATE_DIR:
        (dest / STATE_DIR).rmdir()
        target = outside  # parts/precious.bin would be deleted as a stale part, the journal appended
    else:
        target = outside / "parts"
    (dest / planted).symlink_to(target)
    before = snapshot(outside)
    store = Store()
    assert f"(to '{target}')" in refused(dest, dest / planted, store)
    assert snapshot(outside) == before
    assert store.gets == []  # refused before anything was fetched
    assert not (dest / "config.json").exists()


def test_a_dangling_state_link_is_refused_and_not_created_where_it_points(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / STATE_DIR).symlink_to(tmp_path / "elsewhere")
    refused(dest, dest / STATE_DIR)
    assert not (tmp_path / "elsewhere").exists()


def test_a_journal_link_is_refused_and_the_file_it_points_to_is_not_appended(
    tmp_path: Path, outside: Path
) -> None:
    dest = tmp_path / "dest"
    (dest / STATE_DIR).mkdir(parents=True)
    (dest / STATE_DIR / JOURNAL).symlink_to(outside / JOURNAL)
    before = snapshot(outside)
    refused(dest, dest / STATE_DIR / JOURNAL)
    assert snapshot(outside) == before


def test_a_hard_linked_journal_is_not_appended(tmp_path: Path, outside: Path) -> None:
    dest = tmp_path / "dest"
    (dest / STATE_DIR).mkdir(parents=True)
    os.link(outside / JOURNAL, dest / STATE_DIR / JOURNAL)
    with pytest.raises(FetchError, match=f"{dest / STATE_DIR / JOURNAL}: has 2 names .* remove it"):
        fetch(dest)
    assert (outside / JOURNAL).read_bytes() == b"someone else's log\n"


def test_a_destination_that_is_a_link_is_refused(tmp_path: Path, outside: Path) -> None:
    dest = tmp_path / "dest"
    dest.symlink_to(outside)
    before = snapshot(outside)
    refused(dest, dest)
    assert snapshot(outside) == before


def test_a_folder_link_planted_after_the_stranger_check_is_not_followed(
    tmp_path: Path, outside: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The stranger check sees a link as a file the manifest does not list; this is the race
    # after it: each folder of a manifest path is opened one name at a time, without following.
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "sub").symlink_to(outside)
    monkeypatch.setattr(ModelFetcher, "_check_no_strangers", lambda self: None)
    refused(dest, dest / "sub")
    assert not (outside / "adapter_model.safetensors").exists()


def test_a_part_file_link_planted_after_the_cleanup_is_not_written_through(
    tmp_path: Path, outside: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dest = tmp_path / "dest"
    (dest / STATE_DIR / "parts").mkdir(parents=True)
    (dest / STATE_DIR / "parts" / "0.part").symlink_to(outside / "0.part")
    monkeypatch.setattr(ModelFetcher, "_clear_parts", lambda self: None)  # planted just after it
    with pytest.raises(FetchError, match="0.part: appeared while fetching"):
        fetch(dest)
    assert (outside / "0.part").read_bytes() == b"someone else's file"  # not truncated


def test_stale_part_links_are_deleted_not_followed_and_a_file_link_is_replaced(
    tmp_path: Path, outside: Path
) -> None:
    dest = tmp_path / "dest"
    (dest / STATE_DIR / "parts").mkdir(parents=True)
    (dest / STATE_DIR / "parts" / "7.part").symlink_to(outside / "parts" / "precious.bin")
    (dest / "config.json").symlink_to(outside / "0.part")  # a link where a listed file goes
    before = snapshot(outside)
    fetcher = fetch(dest)
    assert snapshot(outside) == before
    assert list((dest / STATE_DIR / "parts").iterdir()) == []
    assert not (dest / "config.json").is_symlink()
    assert {p: (dest / p).read_bytes() for p in CONTENT} == CONTENT
    assert fetcher.report.rejected == ["config.json"]


def test_a_tampered_file_with_its_mtime_put_back_is_fetched_again_with_reverify(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    fetch(dest)
    victim = dest / "sub" / "adapter_model.safetensors"
    st = victim.stat()
    victim.write_bytes(b"\0" * st.st_size)
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert fetch(dest).report.skipped == [f.path for f in FILES]  # the journal's (size, mtime) shortcut
    report = fetch(dest, reverify=True).report
    name = "sub/adapter_model.safetensors"
    assert (report.rejected, report.fetched, report.skipped) == ([name], [name], ["config.json"])
    assert victim.read_bytes() == CONTENT[name]
