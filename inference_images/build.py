"""Build this repository's images with podman: ``make images`` runs ``python3 inference_images/build.py``.

    python3 inference_images/build.py                    # all four images, on stand-in bases
    python3 inference_images/build.py batch-driver router
    python3 inference_images/build.py --upstream         # the Dockerfiles' own (pinned) bases
    python3 inference_images/build.py --json             # one JSON line per image (for tests)

Upstream bases (``python:3.11.11-slim-bookworm``, ``apache/airflow:3.3.2-python3.11``) cannot be
pulled where no image registry is reachable, so by default each Dockerfile's ``BASE_IMAGE``
build argument points at a stand-in made here once: a Debian bookworm ``debootstrap`` with
Python 3.11 (``localhost/aibrix-standin/python``), and the same with the official Airflow
image's user contract (``localhost/aibrix-standin/airflow``: uid 50000, ``PIP_USER``). The
Dockerfiles are the ones users build; only the base differs (inference_images/README.md).

Builds run with the host's CA bundle and local wheel directory mounted (never copied into a
layer), ``--network host`` (pip reaches the registries the host reaches), runc, and ulimits
this VM allows. podman's layer cache makes an unchanged rebuild take seconds.

One build at a time on a checkout (a lock file under ``.work``), whoever asks: a test that needs an
image while a ``make images`` builds it (``tests/images/containers.py``) waits for it, then finds it
in the cache. Two builds of one tag would race for it.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VERSION = "0.1.0"  # pyproject's version: the tag of every image built here
DEBIAN_MIRROR = "http://deb.debian.org/debian"
# podman on these VMs: crun refuses the cgroup v1 hybrid layout, and a container may not raise
# its limits to podman's defaults.
PODMAN = ["podman", "--runtime", "runc"]
ULIMITS = ["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1000:1000"]
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
WHEELS = "/opt/wheels"  # the CPU torch wheel (Makefile PIP_FLAGS); absent elsewhere
STANDIN_ROOTFS = "localhost/aibrix-standin/rootfs:bookworm"
STANDIN = {
    "python": "localhost/aibrix-standin/python:3.11-bookworm",
    "airflow": "localhost/aibrix-standin/airflow:3.3.2-python3.11",
}


@dataclass(frozen=True)
class ImageSpec:
    name: str  # the image is aibrix-batch/<name>:<VERSION>
    folder: str  # under inference_images/
    standin: str  # key of STANDIN

    @property
    def dockerfile(self) -> Path:
        return REPO / "inference_images" / self.folder / "Dockerfile"

    @property
    def tag(self) -> str:
        return f"localhost/aibrix-batch/{self.name}:{VERSION}"


# Built in this order when no names are given: the small ones first, so a test that needs the
# driver's image (the Kubernetes tests) waits the least behind a `make images` run by hand.
IMAGES = {
    spec.name: spec
    for spec in (
        ImageSpec("batch-driver", "batch_driver", "python"),
        ImageSpec("router", "router", "python"),
        ImageSpec("airflow", "airflow", "airflow"),
        ImageSpec("vllm-cpu", "vllm_cpu", "python"),
    )
}


class BuildError(RuntimeError):
    pass


LOCK = REPO / ".work" / "image-build.lock"


@contextlib.contextmanager
def build_lock() -> Iterator[None]:
    """Held for one image's build (or the stand-ins'), so another build waits rather than races."""
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def podman(*args: str, check: bool = True, capture: bool = True, **kw) -> subprocess.CompletedProcess:
    if shutil.which("podman") is None:
        raise BuildError("podman is not installed: apt-get install -y podman runc debootstrap "
                         "(make system-packages)")
    proc = subprocess.run([*PODMAN, *args], text=True, capture_output=capture, **kw)
    if check and proc.returncode != 0:
        tail = ((proc.stderr or "") + (proc.stdout or "")).strip().splitlines()[-15:]
        raise BuildError(f"podman {' '.join(args[:3])} failed ({proc.returncode}):\n" + "\n".join(tail))
    return proc


def image_exists(tag: str) -> bool:
    return podman("image", "exists", tag, check=False).returncode == 0


def image_size_mb(tag: str) -> float:
    out = podman("image", "inspect", "--format", "{{.Size}}", tag).stdout.strip()
    return int(out) / 1e6


def build_mounts() -> list[str]:
    mounts = []
    if Path(CA_BUNDLE).is_file():
        mounts += ["-v", f"{CA_BUNDLE}:{CA_BUNDLE}:ro"]
    if Path(WHEELS).is_dir():
        mounts += ["-v", f"{WHEELS}:{WHEELS}:ro"]
    return mounts


def ensure_standins(log) -> None:
    """The stand-in bases, made once per machine (about a minute of debootstrap)."""
    if not image_exists(STANDIN_ROOTFS):
        if shutil.which("debootstrap") is None:
            raise BuildError("debootstrap is not installed: apt-get install -y debootstrap "
                             "(make system-packages)")
        work = REPO / ".work"
        work.mkdir(exist_ok=True)
        with tempfile.TemporaryDirectory(dir=work, prefix="standin-") as tmp:
            root = Path(tmp) / "rootfs"
            log(f"debootstrap bookworm into {root} (once per machine)")
            proc = subprocess.run(
                ["debootstrap", "--variant=minbase",
                 "--include=python3,python3-venv,python3-pip,ca-certificates",
                 "bookworm", str(root), DEBIAN_MIRROR],
                capture_output=True, text=True,
            )  # fmt: skip
            if proc.returncode != 0:
                raise BuildError("debootstrap failed:\n" + proc.stdout[-2000:] + proc.stderr[-2000:])
            # What a slim base leaves out: package caches, docs, man pages, locales.
            for junk in ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/man",
                         "usr/share/locale", "usr/share/info"):  # fmt: skip
                shutil.rmtree(root / junk, ignore_errors=True)
                (root / junk).mkdir(parents=True, exist_ok=True)
            tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
            podman("import", "-", STANDIN_ROOTFS, stdin=tar.stdout)
            if tar.wait() != 0:
                raise BuildError("tar of the stand-in rootfs failed")
    for key, containerfile in (("python", "python.Containerfile"), ("airflow", "airflow.Containerfile")):
        build(STANDIN[key], REPO / "inference_images" / "standin" / containerfile, [], log)


def build(tag: str, dockerfile: Path, build_args: list[str], log) -> float:
    started = time.monotonic()
    podman(
        "build", "--layers", "--network", "host", *ULIMITS, *build_mounts(), *build_args,
        "-f", str(dockerfile), "-t", tag, str(REPO),
    )  # fmt: skip
    seconds = time.monotonic() - started
    log(f"built {tag} in {seconds:.1f} s")
    return seconds


def build_image(spec: ImageSpec, *, upstream: bool, log) -> dict:
    args = [] if upstream else ["--build-arg", f"BASE_IMAGE={STANDIN[spec.standin]}"]
    if spec.name == "vllm-cpu" and Path(WHEELS).is_dir():
        # The CPU torch wheel lies on this disk; download.pytorch.org is not reachable here.
        args += ["--build-arg", f"PIP_EXTRA_ARGS=--find-links {WHEELS}"]
    seconds = build(spec.tag, spec.dockerfile, args, log)
    return {"name": spec.name, "tag": spec.tag, "seconds": round(seconds, 1),
            "size_mb": round(image_size_mb(spec.tag), 1)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("images", nargs="*", metavar="IMAGE", help=f"any of {sorted(IMAGES)} (default: all)")
    parser.add_argument("--upstream", action="store_true", help="build on the Dockerfiles' own bases")
    parser.add_argument("--json", action="store_true", help="print one JSON object per image on stdout")
    args = parser.parse_args(argv)
    names = args.images or list(IMAGES)
    unknown = sorted(set(names) - set(IMAGES))
    if unknown:
        parser.error(f"unknown image(s) {unknown}; choose from {sorted(IMAGES)}")

    def log(message: str) -> None:
        print(f"[images] {message}", file=sys.stderr, flush=True)

    try:
        if not args.upstream:
            with build_lock():
                ensure_standins(log)
        for name in names:
            with build_lock():
                result = build_image(IMAGES[name], upstream=args.upstream, log=log)
            print(json.dumps(result) if args.json else f"{result['tag']}  {result['size_mb']} MB", flush=True)
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    os.chdir(REPO)
    sys.exit(main())
