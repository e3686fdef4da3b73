"""The model fetcher (``aibrix_operators.serving.model_fetch``) from a real SeaweedFS, against
three baselines taken in the same run on the same objects.

A generated model (``--mb`` in total: config and tokenizer files, one large shard of half the
size, the rest in three equal shards; random bytes) is uploaded once; then each round, in a
rotating order, downloads it into an empty directory four ways:

  fetcher        ``fetch_model``: parallel ranged GETs, every byte sha256-verified against the
                 manifest while streaming, each file fsynced and renamed into place
  download_file  boto3's ``download_file`` per file, one file after another (``aws s3 cp``'s
                 transfer manager: parallel ranged GETs of a file), no verification
  single GET     one ``get_object`` stream per file, one after another, no verification
  single GET + sha256   the same, hashing each block as it is written (verified, sequential)

MB/s is the model's bytes over wall-clock seconds; medians of ``--rounds``. SeaweedFS runs on
the same two cores, so every figure includes its CPU; compare the ratios.

    .venv/bin/python bench/model_fetch.py                 # 1 GB model, 3 rounds (~2 min)
    .venv/bin/python bench/model_fetch.py --mb 16 --rounds 1
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.integration.services: the SeaweedFS starter the tests use
sys.path.insert(0, str(REPO / "plugins"))

from aibrix_operators.serving.model_fetch import FetchOptions, fetch_model, s3_client  # noqa: E402
from aibrix_operators.serving.model_manifest import MANIFEST_NAME, write_manifest  # noqa: E402
from tests.integration.services import start_seaweedfs, stop_group  # noqa: E402

BUCKET = "bench-models"
PREFIX = "llm"
MB = 1_000_000


def make_model(root: Path, total_mb: int) -> Path:
    model = root / "model"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": 4096}\n')
    (model / "tokenizer.json").write_bytes(os.urandom(2 * MB))
    large = total_mb * MB // 2
    rest = (total_mb * MB - large - 2 * MB) // 3
    sizes = {"model-00001-of-00004.safetensors": large}
    sizes |= {f"model-0000{i}-of-00004.safetensors": rest for i in (2, 3, 4)}
    block = os.urandom(4 * MB)
    for name, size in sizes.items():
        with open(model / name, "wb") as fh:
            for off in range(0, size, len(block)):
                # Distinct blocks: a store that deduplicates must not make this easy.
                fh.write((off.to_bytes(8, "little") + block[8:])[: size - off])
    write_manifest(model)
    return model


def upload(client: Any, model: Path) -> None:
    from boto3.s3.transfer import TransferConfig

    client.create_bucket(Bucket=BUCKET)
    for path in sorted(model.iterdir()):
        client.upload_file(
            str(path), BUCKET, f"{PREFIX}/{path.name}", Config=TransferConfig(max_concurrency=4)
        )


def model_files(model: Path) -> list[str]:
    return sorted(p.name for p in model.iterdir() if p.name != MANIFEST_NAME)


FETCH_OPTIONS = FetchOptions()  # --workers / --chunk-mib change it


def run_fetcher(client: Any, model: Path, dest: Path) -> None:
    report = fetch_model(f"s3://{BUCKET}/{PREFIX}", dest, client=client, options=FETCH_OPTIONS)
    assert len(report.fetched) == len(model_files(model)), report


def run_download_file(client: Any, model: Path, dest: Path) -> None:
    dest.mkdir()
    for name in model_files(model):
        client.download_file(BUCKET, f"{PREFIX}/{name}", str(dest / name))


def run_single_get(client: Any, model: Path, dest: Path) -> None:
    dest.mkdir()
    for name in model_files(model):
        body = client.get_object(Bucket=BUCKET, Key=f"{PREFIX}/{name}")["Body"]
        with open(dest / name, "wb") as fh:
            while block := body.read(8 * 1024 * 1024):
                fh.write(block)


def run_single_get_hashed(client: Any, model: Path, dest: Path) -> None:
    """The simplest verified download: one stream per file, sha256 of each block as it is written."""
    import hashlib
    import json

    want = {f["path"]: f["sha256"] for f in json.loads((model / MANIFEST_NAME).read_text())["files"]}
    dest.mkdir()
    for name in model_files(model):
        body = client.get_object(Bucket=BUCKET, Key=f"{PREFIX}/{name}")["Body"]
        digest = hashlib.sha256()
        with open(dest / name, "wb") as fh:
            while block := body.read(8 * 1024 * 1024):
                digest.update(block)
                fh.write(block)
        assert digest.hexdigest() == want[name], name


METHODS: dict[str, Callable[[Any, Path, Path], None]] = {
    "fetcher (verified)": run_fetcher,
    "single GET + sha256 (verified)": run_single_get_hashed,
    "download_file (no verification)": run_download_file,
    "single GET (no verification)": run_single_get,
}


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def bench(total_mb: int, rounds: int, work: Path) -> dict[str, list[tuple[float, float]]]:
    server = start_seaweedfs(work / "weed", "bench-key", "bench-secret")
    saved = dict(os.environ)
    try:
        os.environ.update(server.env())  # the fetcher's client reads boto3's usual chain
        client = s3_client(FETCH_OPTIONS.workers)
        model = make_model(work, total_mb)
        size = sum((model / n).stat().st_size for n in model_files(model))
        print(f"model: {len(model_files(model))} files, {size / MB:.1f} MB; uploading", flush=True)
        upload(client, model)
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in METHODS}
        names = list(METHODS)
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                dest = work / "dest"
                shutil.rmtree(dest, ignore_errors=True)
                c0, t0 = cpu_s(), time.perf_counter()
                METHODS[name](client, model, dest)
                seconds, cpu = time.perf_counter() - t0, cpu_s() - c0
                for n in model_files(model):  # every method delivered every byte
                    assert (dest / n).stat().st_size == (model / n).stat().st_size, (name, n)
                results[name].append((seconds, cpu))
                print(f"round {r + 1} {name}: {size / MB / seconds:.1f} MB/s, {cpu:.2f} CPU s", flush=True)
        shutil.rmtree(work / "dest", ignore_errors=True)
        results["_size"] = [(size, 0.0)]
        return results
    finally:
        os.environ.clear()
        os.environ.update(saved)
        stop_group(server.proc)


def table(results: dict[str, list[tuple[float, float]]]) -> str:
    size = results["_size"][0][0]
    base = statistics.median(s for s, _ in results["download_file (no verification)"])
    lines = [
        "| method | median s | MB/s | vs download_file | CPU s (this process) |",
        "|---|---|---|---|---|",
    ]
    for name in METHODS:
        secs = statistics.median(s for s, _ in results[name])
        cpu = statistics.median(c for _, c in results[name])
        lines.append(f"| {name} | {secs:.2f} | {size / MB / secs:.1f} | {base / secs:.2f}x | {cpu:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=1000, help="model size in MB (default 1000)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--work", type=Path, default=None, help="scratch directory (default: a temp dir)")
    p.add_argument("--workers", type=int, default=FetchOptions().workers, help="the fetcher's parallel GETs")
    p.add_argument("--chunk-mib", type=int, default=FetchOptions().chunk_bytes >> 20, help="its range size")
    args = p.parse_args(argv)
    global FETCH_OPTIONS
    FETCH_OPTIONS = FetchOptions(workers=args.workers, chunk_bytes=args.chunk_mib << 20)
    print(f"fetcher: {args.workers} workers, {args.chunk_mib} MiB ranges", flush=True)
    work = Path(tempfile.mkdtemp(prefix="bench-model-fetch-", dir=args.work))
    try:
        print(table(bench(args.mb, args.rounds, work)))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
