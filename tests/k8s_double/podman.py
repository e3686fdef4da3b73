"""The fake kubelet's container runtime: podman, with the flags these VMs need (ARCHITECTURE §4).

A pod's container runs attached (``podman run``), so its stdout+stderr are the pod's log and
the client's exit status is the container's exit code. Signals go to the container itself
with ``podman kill``: signalling the client would leave the container running.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import threading
from pathlib import Path

PODMAN = ["podman", "--runtime", "runc"]  # crun refuses this VM's cgroup v1 hybrid layout
RUN_FLAGS = [
    "--rm",
    "--pull", "never",  # no registry: an image that is not built here is an ErrImagePull
    "--network", "host",  # the pod reaches the tests' 127.0.0.1 services, as a hostNetwork pod
    "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1000:1000",
]  # fmt: skip


def start(
    name: str, image: str, command: list[str], args: list[str], env: dict[str, str], workdir: str | None,
    flags: list[str] = (),
) -> subprocess.Popen:
    """Start the container of a pod: ``command`` replaces the image's ENTRYPOINT, ``args`` its CMD;
    ``flags`` are the pod's security context and limits (tests/k8s_double/security.py)."""
    # Secret values go through a private file, never the command line (ps would show them).
    env_dir = Path(tempfile.mkdtemp(prefix="pod-env-"))
    env_file = env_dir / "env"
    fd = os.open(env_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.writelines(f"{key}={value}\n" for key, value in env.items())
    argv = [*PODMAN, "run", *RUN_FLAGS, *flags, "--name", name, "--env-file", str(env_file)]
    if workdir:
        argv += ["--workdir", workdir]
    if command:
        argv += ["--entrypoint", json.dumps(command)]
    argv += [image, *args]
    # In the pod's private directory: when the cgroup OOM-kills the container, conmon writes an
    # "oom" file into podman's working directory (runc on this VM's cgroup v1 reports nothing else:
    # `podman inspect` says OOMKilled false), which is how the kubelet tells an OOM kill.
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        start_new_session=True, cwd=env_dir,
    )
    proc.oom_killed = False  # type: ignore[attr-defined]
    proc.reaped = threading.Event()  # type: ignore[attr-defined]
    threading.Thread(target=_remove_when_done, args=(proc, env_dir), daemon=True).start()
    return proc


def oom_killed(proc: subprocess.Popen, timeout_s: float = 5.0) -> bool:
    """Whether the ended container was killed by its memory limit (waits for its clean-up)."""
    reaped = getattr(proc, "reaped", None)
    if reaped is None:
        return False
    reaped.wait(timeout_s)
    return bool(proc.oom_killed)  # type: ignore[attr-defined]


def kill(name: str, sig: int) -> bool:
    """Send ``sig`` to the container's PID 1; False if there is no such running container (yet)."""
    proc = subprocess.run(
        [*PODMAN, "kill", "--signal", signal.Signals(sig).name, name], capture_output=True, text=True
    )
    if proc.returncode != 0:
        # Not fatal (the kubelet retries on its next sync), but a test that counts on the signal
        # needs to know why it did not land.
        print(f"fake kubelet: podman kill {name} failed: {proc.stderr.strip()}", flush=True)
    return proc.returncode == 0


def remove(name: str) -> None:
    subprocess.run([*PODMAN, "rm", "--force", "--ignore", name], capture_output=True)


def _remove_when_done(proc: subprocess.Popen, env_dir: Path) -> None:
    proc.wait()
    proc.oom_killed = (env_dir / "oom").exists()  # type: ignore[attr-defined]
    for path in env_dir.iterdir():
        path.unlink()
    env_dir.rmdir()
    proc.reaped.set()  # type: ignore[attr-defined]
