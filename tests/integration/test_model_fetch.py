"""The model fetcher's CLI (what a vLLM pod's init container runs) against a real SeaweedFS:
delivery byte for byte, the one-line failures and their exit codes, resume after a kill, and the
paths it refuses to write; and the LoRA cache's fetch (lora/serving.py), which hashes every file
on every load."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError

from aibrix_operators.lora.registry import Adapter
from aibrix_operators.lora.serving import fetch_adapter
from aibrix_operators.serving.model_fetch import EXIT_MISMATCH, EXIT_MISSING, EXIT_USAGE, JOURNAL
from aibrix_operators.serving.model_manifest import FORMAT, MANIFEST_NAME, STATE_DIR, write_manifest
from tests.integration.services import S3Server

pytestmark = pytest.mark.service

BUCKET = "models-test"
MIB = 1024 * 1024
# Small ranges, so even these few-MB files go as several parallel ranged GETs.
CHUNK = str(256 * 1024)


@pytest.fixture(scope="module")
def bucket(s3_server: S3Server) -> str:
    client = s3_server.client()
    if BUCKET not in [b["Name"] for b in client.list_buckets().get("Buckets", [])]:
        client.create_bucket(Bucket=BUCKET)
    return BUCKET


def make_model(root: Path, shards: int = 3, shard_bytes: int = 3 * MIB) -> Path:
    model = root / "model"
    (model / "tok").mkdir(parents=True)
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}\n')
    (model / "tok" / "tokenizer.json").write_bytes(os.urandom(300_000))
    (model / "generation_config.json").write_bytes(b"")  # an empty file is a file too
    for i in range(shards):
        (model / f"model-{i:05d}.safetensors").write_bytes(os.urandom(shard_bytes + i))
    write_manifest(model)
    return model


def publish(s3: S3Server, bucket: str, model: Path) -> str:
    """Upload the model and its manifest under a fresh prefix; its s3:// URI."""
    prefix = f"m-{uuid.uuid4().hex[:8]}"
    client = s3.client()
    for path in sorted(p for p in model.rglob("*") if p.is_file()):
        client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(model).as_posix()}")
    return f"s3://{bucket}/{prefix}"


def published_model(s3: S3Server, bucket: str, root: Path) -> tuple[Path, str]:
    """The default test model made under ``root`` and published: its directory and its s3:// source."""
    model = make_model(root)
    return model, publish(s3, bucket, model)


def model_files(model: Path) -> dict[str, bytes]:
    return {
        p.relative_to(model).as_posix(): p.read_bytes()
        for p in model.rglob("*")
        if p.is_file() and p.name != MANIFEST_NAME and STATE_DIR not in p.parts
    }


def fetch_cmd(source: str, dest: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "aibrix_operators.serving.model_fetch", f"--source={source}",
            f"--dest={dest}", f"--chunk-bytes={CHUNK}", "--workers=4", *extra]  # fmt: skip


def fetch(s3: S3Server, source: str, dest: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **s3.env()}
    return subprocess.run(
        fetch_cmd(source, dest, *extra), env=env, capture_output=True, text=True, timeout=120
    )


def summary(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_file_arrives_byte_identical_and_a_second_run_downloads_nothing(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    model, source = published_model(s3_server, bucket, tmp_path)
    dest = tmp_path / "dest" / "model"
    first = summary(fetch(s3_server, source, dest))
    assert model_files(dest) == model_files(model)
    total = sum(len(b) for b in model_files(model).values())
    assert (first["fetched_files"], first["bytes_downloaded"], first["bytes_total"]) == (6, total, total)
    assert not list((dest / STATE_DIR / "parts").iterdir())  # every part renamed into place
    mtimes = {p: (dest / p).stat().st_mtime_ns for p in model_files(model)}
    second = summary(fetch(s3_server, source, dest))
    assert (second["skipped_files"], second["bytes_downloaded"]) == (6, 0)
    assert {p: (dest / p).stat().st_mtime_ns for p in model_files(model)} == mtimes


def test_a_flipped_byte_fails_with_the_files_name_in_the_termination_message(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    model, source = published_model(s3_server, bucket, tmp_path)
    bad = bytearray((model / "model-00001.safetensors").read_bytes())
    bad[len(bad) // 2] ^= 0x01  # same size: only the digest can tell
    _, _, prefix = source.removeprefix("s3://").partition("/")
    s3_server.client().put_object(Bucket=bucket, Key=f"{prefix}/model-00001.safetensors", Body=bytes(bad))
    dest, log = tmp_path / "dest", tmp_path / "termination-log"
    done = fetch(s3_server, source, dest, f"--termination-log={log}")
    assert done.returncode == EXIT_MISMATCH
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("model fetch failed: model-00001.safetensors: sha256 ") and "re-upload" in line
    assert log.read_text() == line
    assert not (dest / "model-00001.safetensors").exists()
    assert not list((dest / STATE_DIR / "parts").iterdir())


def test_a_longer_object_whose_first_bytes_match_is_refused(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    # Ranged GETs of exactly the manifest's bytes would hash to the manifest's digest: the
    # object's own size (Content-Range) must be checked too.
    model, source = published_model(s3_server, bucket, tmp_path)
    _, _, prefix = source.removeprefix("s3://").partition("/")
    longer = (model / "model-00002.safetensors").read_bytes() + b"extra"
    s3_server.client().put_object(Bucket=bucket, Key=f"{prefix}/model-00002.safetensors", Body=longer)
    done = fetch(s3_server, source, tmp_path / "dest")
    assert done.returncode == EXIT_MISMATCH, done.stderr
    assert f"model-00002.safetensors: {source}/model-00002.safetensors is {len(longer)} bytes" in done.stderr


def test_a_missing_object_fails_naming_it(s3_server: S3Server, bucket: str, tmp_path: Path) -> None:
    model, source = published_model(s3_server, bucket, tmp_path)
    _, _, prefix = source.removeprefix("s3://").partition("/")
    s3_server.client().delete_object(Bucket=bucket, Key=f"{prefix}/tok/tokenizer.json")
    log = tmp_path / "termination-log"
    done = fetch(s3_server, source, tmp_path / "dest", f"--termination-log={log}")
    assert done.returncode == EXIT_MISSING
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("model fetch failed: tok/tokenizer.json: ") and "missing from the store" in line
    assert log.read_text() == line


def test_a_killed_fetch_resumes_without_downloading_the_verified_files_again(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    model = make_model(tmp_path, shards=6, shard_bytes=2 * MIB)
    source = publish(s3_server, bucket, model)
    dest = tmp_path / "dest"
    journal = dest / STATE_DIR / JOURNAL
    # One worker at 6 MB/s: ~2.5 s for the model, so the kill lands mid-way.
    slow = fetch_cmd(source, dest, "--max-bytes-per-s=6000000")
    slow[slow.index("--workers=4")] = "--workers=1"
    proc = subprocess.Popen(slow, env={**os.environ, **s3_server.env()}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)  # fmt: skip
    deadline = time.monotonic() + 60
    while not (journal.exists() and len(journal.read_bytes().splitlines()) >= 3):
        assert proc.poll() is None and time.monotonic() < deadline, "the fetch ended before the kill"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    done_before = [json.loads(line)["path"] for line in journal.read_bytes().splitlines()]
    files = model_files(model)
    assert 3 <= len(done_before) < len(files), done_before
    mtimes = {p: (dest / p).stat().st_mtime_ns for p in done_before}

    resumed = summary(fetch(s3_server, source, dest))
    assert model_files(dest) == files
    assert resumed["skipped_files"] == len(done_before)
    assert resumed["bytes_downloaded"] == sum(len(b) for p, b in files.items() if p not in done_before)
    assert {p: (dest / p).stat().st_mtime_ns for p in done_before} == mtimes  # not rewritten


def test_unrecorded_files_are_rehashed_and_reverify_catches_a_change_in_place(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    model, source = published_model(s3_server, bucket, tmp_path)
    dest = tmp_path / "dest"
    summary(fetch(s3_server, source, dest))
    # A crash between a rename and its journal line: the file is in place, unrecorded.
    (dest / STATE_DIR / JOURNAL).unlink()
    again = summary(fetch(s3_server, source, dest))
    assert (again["skipped_files"], again["bytes_downloaded"]) == (6, 0)
    # A byte changed in place with the mtime put back: the journal trusts size and mtime,
    # --reverify hashes every file and downloads only the changed one.
    victim = dest / "model-00000.safetensors"
    st = victim.stat()
    data = bytearray(victim.read_bytes())
    data[0] ^= 0xFF
    victim.write_bytes(bytes(data))
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    trusted = summary(fetch(s3_server, source, dest))
    assert trusted["bytes_downloaded"] == 0  # what the journal's cheap check can and cannot see
    checked = summary(fetch(s3_server, source, dest, "--reverify"))
    assert (checked["fetched_files"], checked["bytes_downloaded"]) == (1, st.st_size)
    assert checked["rejected_files"] == 1
    assert model_files(dest) == model_files(model)


@pytest.mark.parametrize("evil", ["../escaped.bin", "sub/../../escaped.bin", "/tmp/escaped-abs.bin"])
def test_a_path_outside_dest_is_refused_before_anything_is_written(
    s3_server: S3Server, bucket: str, tmp_path: Path, evil: str
) -> None:
    model, source = published_model(s3_server, bucket, tmp_path)
    # The object exists under that key where the store takes it (SeaweedFS refuses keys with
    # ".."), so only the fetcher's own check stands in the way.
    _, _, prefix = source.removeprefix("s3://").partition("/")
    try:
        s3_server.client().put_object(Bucket=bucket, Key=f"{prefix}/{evil.lstrip('/')}", Body=b"x")
    except ClientError as exc:
        assert ".." in evil, exc
    doc = json.loads((model / MANIFEST_NAME).read_text())
    doc["files"].append(
        {
            "path": evil,
            "size": 1,
            "sha256": "2d711642b726b04401627ca9fbac32f5c8530fb1903cc4db02258717921a4881",
        }
    )
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps(doc))
    dest = tmp_path / "a" / "dest"
    done = fetch(s3_server, source, dest, f"--manifest={manifest}")
    assert done.returncode == EXIT_USAGE
    assert f"manifest path {evil!r}" in done.stderr
    assert not dest.exists()  # refused while reading the manifest: nothing fetched at all
    assert not list(tmp_path.rglob("escaped*")) and not Path("/tmp/escaped-abs.bin").exists()


def test_a_symlink_in_dest_and_stray_files_are_refused(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    model, source = published_model(s3_server, bucket, tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "tok").symlink_to(outside)  # tok/tokenizer.json would land outside dest
    done = fetch(s3_server, source, dest)
    assert done.returncode == EXIT_USAGE and "tok" in done.stderr, done.stderr
    assert list(outside.iterdir()) == []
    (dest / "tok").unlink()
    (dest / "old-shard.safetensors").write_bytes(b"from another model")
    done = fetch(s3_server, source, dest)
    assert done.returncode == EXIT_USAGE
    assert "holds old-shard.safetensors, which the manifest does not list" in done.stderr


def test_a_pinned_manifest_that_differs_is_refused(s3_server: S3Server, bucket: str, tmp_path: Path) -> None:
    model, source = published_model(s3_server, bucket, tmp_path)
    done = fetch(s3_server, source, tmp_path / "dest", "--manifest-sha256=" + "0" * 64)
    assert done.returncode == EXIT_USAGE
    assert f"manifest {source}/{MANIFEST_NAME}: sha256 " in done.stderr and "pinned" in done.stderr
    assert not (tmp_path / "dest").exists()
    import hashlib

    pin = hashlib.sha256((model / MANIFEST_NAME).read_bytes()).hexdigest()
    assert (
        summary(fetch(s3_server, source, tmp_path / "dest", f"--manifest-sha256={pin}"))["fetched_files"] == 6
    )
    assert json.loads((model / MANIFEST_NAME).read_text())["format"] == FORMAT


class CountingClient:
    """A real boto3 client that notes which keys were read."""

    def __init__(self, client: Any) -> None:
        self.client, self.keys = client, []

    def get_object(self, **kwargs: Any) -> Any:
        self.keys.append(kwargs["Key"])
        return self.client.get_object(**kwargs)


def test_a_lora_adapter_changed_in_the_cache_with_its_mtime_put_back_is_fetched_again(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """The LoRA cache is a volume every Airflow worker can write: its journal's (size, mtime)
    proves nothing, so every load hashes every file, and one whose bytes are not the manifest's
    is downloaded again from the store and verified before vLLM is pointed at the folder."""
    adapter_src = tmp_path / "adapter"
    adapter_src.mkdir()
    (adapter_src / "adapter_config.json").write_text('{"r": 8, "peft_type": "LORA"}\n')
    (adapter_src / "adapter_model.safetensors").write_bytes(os.urandom(700_000))
    write_manifest(adapter_src)
    source = publish(s3_server, bucket, adapter_src)
    pin = hashlib.sha256((adapter_src / MANIFEST_NAME).read_bytes()).hexdigest()
    adapter = Adapter("sql", "base", source + "/", pin)
    cache = tmp_path / "lora-cache"
    folder = fetch_adapter(adapter, cache, s3_server.client())
    assert model_files(folder) == model_files(adapter_src)

    weights = folder / "adapter_model.safetensors"
    st = weights.stat()
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size, mtime put back: the journal's check cannot see it
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))

    client = CountingClient(s3_server.client())
    assert fetch_adapter(adapter, cache, client) == folder
    assert model_files(folder) == model_files(adapter_src)  # the store's verified bytes again
    prefix = source.removeprefix(f"s3://{bucket}/")
    # The manifest, then only the changed file: the intact one was hashed, not downloaded.
    assert set(client.keys) == {f"{prefix}/{MANIFEST_NAME}", f"{prefix}/adapter_model.safetensors"}


def test_a_planted_state_link_fails_the_cli_naming_it_with_nothing_deleted_or_written_there(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """``.model-fetch`` linked to someone else's folder: the old fetcher deleted what was in its
    ``parts/`` as stale parts and appended its journal there."""
    model = make_model(tmp_path, shards=1, shard_bytes=100_000)
    source = publish(s3_server, bucket, model)
    outside = tmp_path / "outside"
    (outside / "parts").mkdir(parents=True)
    (outside / "parts" / "precious.bin").write_bytes(b"not the fetcher's")
    (outside / JOURNAL).write_bytes(b"someone else's log\n")
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / STATE_DIR).symlink_to(outside)
    log = tmp_path / "termination-log"
    done = fetch(s3_server, source, dest, f"--termination-log={log}")
    assert done.returncode == EXIT_USAGE, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line == (
        f"model fetch failed: {dest / STATE_DIR}: is a symbolic link (to '{outside}'), not a directory; "
        "the fetcher follows no links in its destination (another writer may have planted it): "
        "remove the link and fetch again"
    )
    assert log.read_text() == line
    assert (outside / "parts" / "precious.bin").read_bytes() == b"not the fetcher's"
    assert (outside / JOURNAL).read_bytes() == b"someone else's log\n"
    assert {p.name for p in outside.rglob("*")} == {JOURNAL, "parts", "precious.bin"}
    assert [p.name for p in dest.iterdir()] == [STATE_DIR]  # nothing fetched
    (dest / STATE_DIR).unlink()  # what the message says to do
    assert summary(fetch(s3_server, source, dest))["fetched_files"] == 4
