"""Helpers shared by the kvcache tests (imported by conftest and test modules)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis

from kvcache.launch import LocalServer, free_port


class RedisServer:
    """redis-server on 127.0.0.1 that a test can stop and start again on the same port."""

    def __init__(self, port: int | None = None, password: str | None = None) -> None:
        self.port = port or free_port()
        # The URL never carries the password (the connector reads it from env or a file).
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.password = password
        self.proc: subprocess.Popen | None = None

    def start(self) -> RedisServer:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server not installed: apt-get install -y redis-server")
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        stdin = None
        if self.password:
            # Through a config on stdin ("-"), so the password is not in redis-server's argv.
            args.insert(1, "-")
            stdin = subprocess.PIPE
        self.proc = subprocess.Popen(args, stdin=stdin, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if self.password:
            assert self.proc.stdin is not None
            self.proc.stdin.write(f"requirepass {self.password}\n".encode())
            self.proc.stdin.close()
        client = self.client()
        for _ in range(100):
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not come up")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        self.proc = None

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, password=self.password)



@contextmanager
def servers_on_one_redis(
    make: Callable[[dict[str, Any]], tuple[LocalServer, ...]],
) -> Iterator[tuple[RedisServer, tuple[LocalServer, ...]]]:
    """A redis-server, and the servers ``make`` builds from the connector extra_config that gives them
    its L2 tier to share, started side by side (a start is mostly waiting). Everything stops at the
    end, also when a server failed to start."""
    redis_srv = RedisServer().start()
    # A Redis read slower than l2_redis_timeout_s marks L2 down for a moment: a load is then a
    # miss and a handoff ends "unavailable", not what these tests check. The default 0.5 s was
    # exceeded once while the two workers' servers shared the cores (make test-inference, 2026-12-03).
    shared = {"l2_backend": "redis", "l2_redis_url": redis_srv.url, "l2_redis_timeout_s": 2.0}
    try:
        servers = make(shared)
        try:
            with ThreadPoolExecutor(len(servers)) as pool:
                list(pool.map(lambda s: s.start(), servers))
            yield redis_srv, servers
        finally:
            for server in servers:
                server.stop()
    finally:
        redis_srv.stop()


def scrape(port: int) -> dict[str, float]:
    """The connector's prometheus metrics as {name{labels}: value}."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def random_prompt(n: int, seed: int) -> list[int]:
    """Token ids from a seeded generator (prompts as token lists: exact lengths)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(100, 2000) for _ in range(n)]


def greedy(resp: dict) -> tuple[str, list[float]]:
    choice = resp["choices"][0]
    return choice["text"], list(choice["logprobs"]["token_logprobs"])


# Allowed |delta logprob| between a hit and a full prefill. vLLM's own prefix cache gives
# up to 4.8e-7 on AMD EPYC (one float32 ulp at |logprob| ~ 7) and 0 on the Intel machine
# the suite was written on; 1e-5 leaves a 20x margin for other CPUs. Tokens are compared
# exactly, and the KV bytes themselves are checked bit for bit elsewhere (the crc32 of an
# L2 record, and the worker round-trip tests' torch.equal).
LOGPROB_TOL = 1e-5


def completion(resp: dict[str, Any]) -> tuple[list[str], list[float]]:
    lp = resp["choices"][0]["logprobs"]
    return list(lp["tokens"]), [float(x) for x in lp["token_logprobs"]]


def max_logprob_delta(a: dict[str, Any], b: dict[str, Any]) -> float:
    (_, la), (_, lb) = completion(a), completion(b)
    return max(abs(x - y) for x, y in zip(la, lb, strict=True))


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Same greedy tokens exactly; logprobs within the justified tolerance."""
    (tg, _), (tw, _) = completion(got), completion(want)
    assert tg == tw
    assert max_logprob_delta(got, want) <= LOGPROB_TOL


def load_make_lora() -> Callable[..., Path]:
    """``make_lora(base, out, seed, rank)`` from inference_images/vllm/make_lora.py (an
    image's tool, not an installed package), so tests serve the adapters it writes."""
    path = Path(__file__).resolve().parents[2] / "inference_images" / "vllm" / "make_lora.py"
    spec = importlib.util.spec_from_file_location("make_lora", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_lora
