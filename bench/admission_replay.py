"""Admission replayed over a simulated day: do admitted batches meet their windows, and how good
are the estimates? (issue 40: every admitted batch meets its window; the estimate's error <= 15 %
once 10 % of a batch is done.)

One endpoint serves batches earliest deadline first, at a capacity that drifts (by up to
``--drift``, 10 %, a minute, between 70 % and 130 % of ``--capacity``; seeded). Batches arrive
as a Poisson process over 24 h with sizes, prompt lengths, max_tokens and windows drawn from a
seed; what a batch really needs differs from what validation sees: each answer uses a random share
of its max_tokens, and its prompt a random number of tokens per byte. Admission
is the pipeline's own (``batch/admission.py``): ``estimate`` behind the queued work with earlier
deadlines, at the rate learned with ``measured`` / ``Rate.learn`` from the batches finished so far,
``refuse`` for windows it cannot meet. Until a first batch has finished there is no rate, and
batches are admitted "with no measurement".

Three live estimates are scored at the moment a batch is 10 % done, against when it really ends:
``own`` (the batch's own rate: now + remaining x elapsed / answered, what the Batch API showed
before 2026-12-06), ``api`` (what it shows now: the batch's remaining tokens at the learned rate)
and ``queue`` (the admission estimate again, from that moment: those tokens behind the remaining
work of earlier deadlines, at the learned rate).

    .venv/bin/python bench/admission_replay.py                       # seed 1, 24 h
    .venv/bin/python bench/admission_replay.py --seeds 1,2,3 --json /tmp/admission.json
    .venv/bin/python bench/admission_replay.py --non-preemptive    # a started batch keeps the endpoint

``--non-preemptive`` (2026-12-07): the order the pipeline does not have yet, tried here first. A
batch that has started keeps the endpoint until it ends; the waiting ones go by deadline, and
admission counts the started batch's remaining work ahead of every newcomer. At 10 % done nothing
can come ahead of a batch any more, so its estimate errs only by the rate and its own tokens.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins"))

from aibrix_operators.batch.admission import Rate, Work, estimate, measured, work_tokens  # noqa: E402

KEY = "model @ endpoint"
WINDOWS_S = (3600, 2 * 3600, 4 * 3600, 8 * 3600, 24 * 3600)
STEP_S = 1.0  # the simulation's tick
STARTED = -1.0  # the order key of a batch that keeps the endpoint (--non-preemptive): before any deadline


@dataclass
class Batch:
    id: int
    arrival: float
    deadline: float
    work: Work
    true_tokens: float
    true_input: float
    true_output: float
    estimate_tokens: int | None = None
    done_tokens: float = 0.0
    started: float | None = None
    finished: float | None = None
    eta_own: float | None = None
    eta_queue: float | None = None
    eta_api: float | None = None
    tenth_at: float | None = None
    admitted_feasible: bool | None = None
    answered: int = field(default=0)
    engine_s: float = 0.0  # the endpoint's time it was served, what the drivers measure


def draw_batches(rng: random.Random, hours: float, per_hour: float) -> list[Batch]:
    out, t = [], 0.0
    while True:
        t += rng.expovariate(per_hour / 3600)
        if t > hours * 3600:
            return out
        requests = int(min(50_000, max(50, rng.lognormvariate(7.0, 1.2))))
        line_bytes = rng.choice((400, 1200, 4000))
        max_tokens = rng.choice((64, 256, 1024))
        tokens_per_byte = rng.uniform(0.22, 0.30)
        used = rng.uniform(0.3, 0.9)  # the share of max_tokens answers really use, this batch
        true_input = requests * line_bytes * tokens_per_byte
        true_output = requests * max_tokens * used
        work = Work(requests, requests * line_bytes, requests * max_tokens, 0)
        window = rng.choice(WINDOWS_S)
        out.append(Batch(len(out), t, t + window, work, true_input + true_output, true_input, true_output))


def replay(seed: int, hours: float = 24.0, per_hour: float = 6.0, capacity: float = 6000.0,
           drift_step: float = 0.1, non_preemptive: bool = False) -> dict:
    rng = random.Random(seed)
    arrivals = draw_batches(rng, hours, per_hour)
    rate: Rate | None = None
    admitted: list[Batch] = []
    refused: list[Batch] = []
    no_measurement = 0
    now, i, drift = 0.0, 0, 1.0
    # (deadline, id, batch): earliest deadline first; non_preemptive: the started batch first.
    running: list[tuple[float, int, Batch]] = []

    def ahead_key(x: Batch) -> float:
        return STARTED if non_preemptive and x.started is not None else x.deadline
    while i < len(arrivals) or running:
        if int(now) % 60 == 0:
            drift = min(1.3, max(0.7, drift * rng.uniform(1 - drift_step, 1 + drift_step)))
        while i < len(arrivals) and arrivals[i].arrival <= now:
            b = arrivals[i]
            i += 1
            # The queue as the deployment keeps it: every admitted batch's work, at today's rate.
            queue = [] if rate is None else sorted((int(ahead_key(x)), work_tokens(x.work, rate))
                                                   for _, _, x in running)
            est = estimate(b.work, rate, queue, now, int(b.arrival), int(b.deadline))
            if est.feasible is False:
                refused.append(b)
                continue
            no_measurement += est.feasible is None
            b.estimate_tokens, b.admitted_feasible = est.tokens, est.feasible
            admitted.append(b)
            heapq.heappush(running, (b.deadline, b.id, b))
        budget = capacity * drift * STEP_S
        while budget > 0 and running:
            _, _, b = running[0]
            if b.started is None:
                b.started = now
                if non_preemptive:
                    heapq.heapreplace(running, (STARTED, b.id, b))
            take = min(budget, b.true_tokens - b.done_tokens)
            b.done_tokens += take
            b.engine_s += take / (capacity * drift)
            budget -= take
            if b.tenth_at is None and b.done_tokens >= 0.1 * b.true_tokens:
                b.tenth_at = now + STEP_S
                elapsed = b.tenth_at - b.started
                b.eta_own = b.tenth_at + elapsed * 9  # remaining x elapsed / done, at 10 %
                if rate is not None:
                    # What the deployment knows then: this batch's tokens per answer so far (so its
                    # remaining tokens), the others' too once they have started, else their estimate.
                    ahead = sum((x.true_tokens - x.done_tokens) if x.started is not None
                                else (x.estimate_tokens or 0) for _, _, x in running
                                if x is not b and ahead_key(x) <= ahead_key(b))
                    b.eta_queue = b.tenth_at + (ahead + 0.9 * b.true_tokens) / rate.tokens_per_s
                    # What the Batch API shows (batch_api/status.py): its own tokens left, at the rate.
                    b.eta_api = b.tenth_at + 0.9 * b.true_tokens / rate.tokens_per_s
            if b.done_tokens >= b.true_tokens - 1e-6:
                heapq.heappop(running)
                b.finished = now + STEP_S - budget / (capacity * drift)
                new = measured(KEY, round(b.true_input), round(b.true_output), b.engine_s, b.work.input_bytes,
                               b.work.requests, int(now))
                if new is not None:
                    rate = rate.learn(new) if rate is not None else new
        now += STEP_S

    def errors(kind: str) -> list[float]:
        out = []
        for b in admitted:
            eta = {"own": b.eta_own, "queue": b.eta_queue, "api": b.eta_api}[kind]
            if eta is None or b.finished is None or b.tenth_at is None:
                continue
            out.append(abs(eta - b.finished) / max(b.finished - b.tenth_at, 1.0))
        return out

    missed = [b.id for b in admitted if b.finished is not None and b.finished > b.deadline
              and b.admitted_feasible is not None]
    missed_unmeasured = [b.id for b in admitted if b.finished is not None and b.finished > b.deadline
                         and b.admitted_feasible is None]
    result = {"seed": seed, "drift_step": drift_step, "non_preemptive": non_preemptive,
              "batches": len(arrivals), "admitted": len(admitted),
              "refused": len(refused),
              "admitted_without_measurement": no_measurement, "missed_windows": missed,
              "missed_windows_admitted_without_measurement": missed_unmeasured}
    for kind in ("own", "queue", "api"):
        errs = sorted(errors(kind))
        if errs:
            result[f"eta_error_{kind}"] = {
                "n": len(errs), "p50": round(statistics.median(errs), 4),
                "p90": round(errs[int(0.9 * (len(errs) - 1))], 4), "max": round(errs[-1], 4),
                "share_within_15pct": round(sum(e <= 0.15 for e in errs) / len(errs), 4)}
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="1", help="comma-separated seeds (default 1)")
    p.add_argument("--hours", type=float, default=24.0)
    p.add_argument("--per-hour", type=float, default=6.0, help="batch arrivals per hour")
    p.add_argument("--capacity", type=float, default=6000.0,
                   help="the endpoint's tokens/s (it drifts +-30 %%)")
    p.add_argument("--drift", type=float, default=0.1,
                   help="the capacity's step a minute, as a fraction (0: a steady endpoint)")
    p.add_argument("--non-preemptive", action="store_true",
                   help="a started batch keeps the endpoint until it ends (the others by deadline)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    results = [replay(int(seed), args.hours, args.per_hour, args.capacity, args.drift, args.non_preemptive)
               for seed in args.seeds.split(",")]
    for r in results:
        print(json.dumps(r))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
