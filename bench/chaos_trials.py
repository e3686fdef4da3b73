"""Randomized fault trials of the batch driver: kills, endpoint outages, 503/429 storms,
and slow, half, dropped and garbled answers, against one shard.

Each trial runs the driver CLI (the driver pod's entry point) as a process against the
fake OpenAI server in its seeded chaos mode (tests/fake_openai.py), and plays Airflow: a
killed driver, or one that gave up on an outage (exit 3) or a store (exit 5), is started
again. A trial passes when every request is answered exactly once in the result log, with no error line
(every fault here is the infrastructure's), and the requests re-sent because of a kill
stay within that kill's checkpoint window (answers received since the last flush).

    .venv/bin/python bench/chaos_trials.py                  # 100 trials
    .venv/bin/python bench/chaos_trials.py --trials 5 --requests 500
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # tests.fake_openai: the one fake OpenAI server of tests and benches

from aibrix_operators.batch.shard_results import shard_result_log  # noqa: E402
from aibrix_operators.storage import LocalStorage  # noqa: E402
from tests.fake_openai import FakeOpenAI  # noqa: E402

FLUSH_INTERVAL_S = 0.2
# A kill's window starts at the newest answer that reached the log (when the last segment took
# its lines from memory), not at the segment file's mtime: the write ends later, by milliseconds
# alone and by more on a loaded machine (a clean clone's parallel pass, 2026-12-06: one answer
# outside an mtime-based window, 65 > 64). Answers the server sent just before that newest one
# can reach the driver's event loop just after it, hence the slack.
WRITE_SLACK_S = 0.2
DRIVER_ARGS = [
    "--concurrency",
    "16",
    "--max-attempts",
    "5",
    "--backoff-base",
    "0.05",
    "--backoff-max",
    "0.5",
    "--request-timeout",
    "2",
    "--connect-timeout",
    "1",
    "--flush-interval",
    str(FLUSH_INTERVAL_S),
    "--probe-interval",
    "0.1",
    "--outage-budget",
    "1.5",
    "--endpoint-wait",
    "10",
    "--progress-interval",
    "60",
]


@dataclass
class TrialResult:
    seed: int
    requests: int
    seconds: float = 0.0
    kills: int = 0
    outages: int = 0
    storms: int = 0
    driver_runs: int = 0
    infra_exits: int = 0  # driver runs that gave up on the endpoint or the store (Airflow retries them)
    lost: int = 0
    duplicated: int = 0
    error_lines: int = 0
    resent_by_kills: int = 0
    kill_window_answers: int = 0  # answers since the last durable checkpoint at each kill, summed
    kill_over_window: int = 0  # kills whose re-sent requests exceeded their window
    max_checkpoint_age_s: float = 0.0  # at a kill, how old the last durable checkpoint was
    faults: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        bad = self.lost or self.duplicated or self.error_lines or self.kill_over_window
        return not (bad or self.problems)


def write_shard(path: Path, n: int) -> str:
    with open(path, "w") as fh:
        for i in range(n):
            cid = f"c-{i:05d}"
            fh.write(
                json.dumps(
                    {
                        "custom_id": cid,
                        "method": "POST",
                        "url": "/v1/chat/completions",
                        "body": {
                            "model": "m",
                            "cid": cid,
                            "messages": [{"role": "user", "content": f"q {i}"}],
                        },
                    }
                )
                + "\n"
            )
    return str(path)


class _Driver:
    """The driver process of the moment, which the chaos thread may kill."""

    def __init__(self, cmd: list[str], log_path: Path) -> None:
        self.cmd = cmd
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.killed = False
        self.lock = threading.Lock()

    def start(self) -> subprocess.Popen:
        with self.lock:
            self.killed = False
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=log)
            return self.proc

    def kill(self) -> bool:
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                return False
            self.killed = True
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
            return True


def run_trial(seed: int, workdir: Path, requests: int = 800, time_limit_s: float = 120.0) -> TrialResult:
    rng = random.Random(seed)
    result = TrialResult(seed, requests)
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    shard = write_shard(workdir / "shard.jsonl", requests)
    prefix = str(workdir / "results")
    storage = LocalStorage()
    log = shard_result_log(storage, prefix, shard)
    server = FakeOpenAI(chaos=seed).start()
    driver = _Driver(
        [
            sys.executable,
            "-m",
            "aibrix_operators.driver.cli",
            "--shard-uri",
            shard,
            "--results-prefix",
            prefix,
            "--endpoint",
            server.url,
            *DRIVER_ARGS,
        ],
        workdir / "driver.log",
    )
    # Events fire when the server has answered a random share of the shard.
    plan = sorted(
        (rng.uniform(0.05, 0.9), rng.choice(("kill", "kill", "outage", "storm503", "storm429")))
        for _ in range(rng.randint(1, 4))
    )
    done = threading.Event()

    def chaos() -> None:
        for share, kind in plan:
            while len(server.answered) < share * requests:
                if done.wait(0.005):
                    return
            if kind == "kill":
                killed_at = time.time()
                if driver.kill():
                    result.kills += 1
                    segments = log.segments()
                    last = max((os.path.getmtime(s) for s in segments), default=started_wall)
                    result.max_checkpoint_age_s = max(result.max_checkpoint_age_s, round(killed_at - last, 3))
                    durable = log.done_ids()
                    with server.lock:
                        answered = set(server.answered)
                        newest = max((max(server.answered[c]) for c in durable if server.answered.get(c)),
                                     default=started_wall)
                        window = sum(
                            1 for ts in server.answered.values() for t in ts if t >= newest - WRITE_SLACK_S
                        )
                    not_durable = len(answered - durable)
                    result.resent_by_kills += not_durable
                    result.kill_window_answers += window
                    if not_durable > window:
                        result.kill_over_window += 1
                        result.problems.append(f"kill re-sends {not_durable} > window {window}")
            elif kind == "outage":
                result.outages += 1
                server.down()
                time.sleep(rng.uniform(0.3, 2.5))  # past 1.5 s the driver gives up: exit 3
                server.up()
            else:
                result.storms += 1
                server.storm = int(kind[-3:])
                time.sleep(rng.uniform(0.3, 2.0))
                server.storm = None

    started_wall = time.time()
    thread = threading.Thread(target=chaos, daemon=True)
    started = time.monotonic()
    started_wall = time.time()
    thread.start()
    try:
        while True:
            if time.monotonic() - started > time_limit_s:
                result.problems.append(f"not finished in {time_limit_s:.0f}s")
                break
            proc = driver.start()
            result.driver_runs += 1
            code = proc.wait()
            if driver.killed:
                continue
            if code == 0:
                break
            if code in (3, 5):
                result.infra_exits += 1
                continue
            tail = (workdir / "driver.log").read_text()[-2000:]
            result.problems.append(f"driver exited {code}: {tail}")
            break
    finally:
        done.set()
        thread.join(30)
        driver.kill()
        server.stop()
    result.seconds = round(time.monotonic() - started, 2)
    counts = Counter(cid for cid, _ in log.iter_records())
    expected = {f"c-{i:05d}" for i in range(requests)}
    result.lost = len(expected - set(counts))
    result.duplicated = sum(n - 1 for n in counts.values())
    result.error_lines = sum(1 for _, line in log.iter_records() if json.loads(line)["error"] is not None)
    result.faults = dict(server.faults)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=100)
    p.add_argument("--requests", type=int, default=800, help="requests per trial's shard")
    p.add_argument("--seed", type=int, default=1, help="first trial's seed; trial i uses seed + i")
    p.add_argument("--workdir", type=Path, default=REPO / ".work" / "bench" / "chaos")
    p.add_argument("--json", type=Path, default=None, help="write every trial's result here")
    args = p.parse_args(argv)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    results = []
    for i in range(args.trials):
        r = run_trial(args.seed + i, args.workdir / f"trial-{i}", args.requests)
        results.append(r)
        print(
            f"trial {i:3d} seed {r.seed}: {'ok  ' if r.ok else 'FAIL'} {r.seconds:5.1f}s kills={r.kills} "
            f"outages={r.outages} storms={r.storms} runs={r.driver_runs} infra_exits={r.infra_exits} "
            f"resent_by_kills={r.resent_by_kills}/{r.kill_window_answers} "
            f"ckpt_age={r.max_checkpoint_age_s:.2f}s lost={r.lost} "
            f"dup={r.duplicated} errors={r.error_lines} {'; '.join(r.problems)[:300]}",
            flush=True,
        )
    total = Counter()
    for r in results:
        total.update({k: v for k, v in asdict(r).items() if isinstance(v, int) and k != "seed"})
        total.update({f"fault:{k}": v for k, v in r.faults.items()})
    failed = [r.seed for r in results if not r.ok]
    print(f"\n{len(results)} trials x {args.requests} requests: {len(results) - len(failed)} passed")
    print(
        f"lost {total['lost']}, duplicated {total['duplicated']}, error lines {total['error_lines']} "
        "(every fault is the infrastructure's, so all three must be 0)"
    )
    print(
        f"kills {total['kills']}, outages {total['outages']}, storms {total['storms']}, driver runs "
        f"{total['driver_runs']}, gave up and retried {total['infra_exits']}"
    )
    oldest = max((r.max_checkpoint_age_s for r in results), default=0.0)
    print(
        f"re-sent because of kills {total['resent_by_kills']} (answers since the last durable "
        f"checkpoint at each kill: {total['kill_window_answers']}; kills over that window: "
        f"{total['kill_over_window']}; oldest checkpoint at a kill {oldest:.2f}s, flush interval "
        f"{FLUSH_INTERVAL_S}s)"
    )
    print(
        "per-attempt faults served: "
        + ", ".join(f"{k[6:]} {v}" for k, v in sorted(total.items()) if k.startswith("fault:"))
    )
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
