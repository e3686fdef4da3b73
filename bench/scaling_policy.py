"""Scaling policy bench: time per decision, and a simulated 24 h batch of 1,000,000 requests.

1. **Decision time**: ``decide()`` for both roles on varied inputs with a full
   stabilization history, timed one call at a time (median, p99). Target < 1 ms.
2. **Simulated batch**: a P/D serving group against a per-replica throughput model
   (below) with randomized noise, driven by the policy every ``--interval`` seconds,
   against two baselines: a fixed max-size deployment held for the batch window (what a
   deployment sized for the peak costs), and the same fixed deployment torn down the
   moment the batch ends (a baseline that knows the future). Reports GPU-hours, finish
   time, and the worst lateness over the noise seeds.

The throughput model, per pod (one GPU each; replicas move in pod groups of 2):

* prefill is compute-bound: ``prefill_tps`` prompt tokens/s, whatever the load;
* decode is memory-bound: a pod with ``b`` sequences in its batch generates
  ``decode_tps * b / (b + batch_half)`` tokens/s, ``b`` at most ``kv_batch`` (its KV
  memory); the drivers keep ``in_flight`` requests outstanding in all, so more decode
  pods than needed means smaller batches and less work per GPU-hour;
* noise, drawn per seed: each role's true capacity is its nominal (what the policy is
  told) times a factor in [0.75, 1.10], every interval times a log-normal jitter
  (sigma 0.10), and each new pod takes 300 s x U(0.8, 1.6) to become ready.

Run: ``.venv/bin/python bench/scaling_policy.py`` (add ``--seeds 50`` for more noise draws).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from dataclasses import dataclass, field

from aibrix_operators.scaling.policy import (
    Recommendation,
    RemainingWork,
    RoleObservation,
    RolePolicy,
    RoleState,
    decide,
)

DAY = 86_400.0


@dataclass(frozen=True)
class Model:
    requests: int = 1_000_000
    prompt_tokens: float = 1500.0  # mean per request
    max_tokens: float = 512.0  # mean max_tokens per request
    output_ratio: float = 0.6  # generated / max_tokens
    prefill_tps: float = 3000.0  # nominal prompt tokens/s per prefill pod
    decode_tps: float = 1000.0  # nominal peak output tokens/s per decode pod
    batch_half: float = 32.0
    kv_batch: float = 256.0
    in_flight: float = 2048.0
    window_s: float = DAY
    startup_s: float = 300.0


def policies(m: Model, max_replicas: int = 16) -> dict[str, RolePolicy]:
    common = {"min_replicas": 2, "max_replicas": max_replicas, "gang_size": 2, "startup_s": m.startup_s,
              "tail_s": 600.0, "target_utilization": 0.85}
    return {
        "prefill": RolePolicy.prefill(nominal_tokens_per_s=m.prefill_tps, **common),
        # The nominal decode figure a benchmark gives at a full KV batch.
        "decode": RolePolicy.decode(
            nominal_tokens_per_s=m.decode_tps * m.kv_batch / (m.kv_batch + m.batch_half), **common),
    }


@dataclass
class Role:
    spec: int
    ready_at: list[float] = field(default_factory=list)  # one entry per pod

    def ready(self, now: float) -> int:
        return sum(1 for t in self.ready_at if t <= now)

    def scale(self, n: int, now: float, rng: random.Random, startup_s: float) -> None:
        if n > len(self.ready_at):
            self.ready_at += [now + startup_s * rng.uniform(0.8, 1.6) for _ in range(n - len(self.ready_at))]
        elif n < len(self.ready_at):
            self.ready_at.sort()  # drop the newest (not yet ready) pods first
            del self.ready_at[n:]
        self.spec = n


@dataclass
class Outcome:
    finish_s: float
    gpu_hours: float
    peak_pods: int
    decisions: int


def simulate(m: Model, seed: int, autoscale: bool, max_replicas: int = 16, interval: float = 60.0,
             dt: float = 30.0) -> Outcome:
    rng = random.Random(seed)
    bias = {"prefill": rng.uniform(0.75, 1.10), "decode": rng.uniform(0.75, 1.10)}
    pols = policies(m, max_replicas)
    roles = {name: Role(0) for name in pols}
    for name, role in roles.items():
        role.scale(pols[name].min_replicas if autoscale else max_replicas, 0.0, rng, m.startup_s)
    states: dict[str, RoleState] = {name: RoleState() for name in pols}
    done = 0.0
    gen_tokens = 0.0
    pod_seconds = 0.0
    peak = 0
    now = 0.0
    last_decision = -math.inf
    obs_tps = {"prefill": None, "decode": None}
    obs_load = {"prefill": (0.0, 0.0, 0.0), "decode": (0.0, 0.0, 0.0)}
    decisions = 0
    while done < m.requests:
        if autoscale and now - last_decision >= interval:
            left = m.requests - done
            ratio = gen_tokens / (done * m.max_tokens) if done > 0 else 1.0  # learnt from answers
            work = RemainingWork(math.ceil(left), left * m.prompt_tokens, left * m.max_tokens * ratio)
            for name, pol in pols.items():
                running, waiting, kv = obs_load[name]
                obs = RoleObservation(roles[name].spec, roles[name].ready(now), obs_tps[name],
                                      running, waiting, kv)
                d = decide(pol, work, obs, now, m.window_s, states[name])
                states[name] = d.state
                decisions += 1
                if d.desired_replicas != roles[name].spec:
                    roles[name].scale(d.desired_replicas, now, rng, m.startup_s)
            last_decision = now
        n_pre, n_dec = roles["prefill"].ready(now), roles["decode"].ready(now)
        jitter = {k: math.exp(rng.gauss(0, 0.10)) for k in pols}
        pre_cap = n_pre * m.prefill_tps * bias["prefill"] * jitter["prefill"] / m.prompt_tokens  # req/s
        out_per_req = m.max_tokens * m.output_ratio
        if n_dec:
            b = min(m.in_flight / n_dec, m.kv_batch)
            dec_peak = m.decode_tps * bias["decode"] * jitter["decode"]
            dec_cap = n_dec * dec_peak * b / (b + m.batch_half) / out_per_req
        else:
            b, dec_peak, dec_cap = 0.0, 0.0, 0.0
        rate = min(pre_cap, dec_cap)
        step = min(rate * dt, m.requests - done)
        done += step
        gen_tokens += step * out_per_req
        # What vLLM's /metrics would show: the bottleneck queues; decode's batch fills its KV.
        pre_bottleneck = pre_cap <= dec_cap
        obs_tps["prefill"] = rate * m.prompt_tokens if n_pre else None
        obs_tps["decode"] = rate * out_per_req if n_dec else None
        queued = max(m.in_flight - n_dec * m.kv_batch, 0.0)
        obs_load["prefill"] = (float(n_pre), 8.0 * n_pre if pre_bottleneck else 0.0, 0.0)
        if n_dec and dec_cap > 0:
            x = min(rate * out_per_req / (n_dec * dec_peak), 0.999)  # batch that gives this rate
            b_used = min(m.batch_half * x / (1 - x), b)
            obs_load["decode"] = (b_used * n_dec, queued + (0.0 if pre_bottleneck else 2.0 * n_dec),
                                  b_used / m.kv_batch)
        pods = len(roles["prefill"].ready_at) + len(roles["decode"].ready_at)  # billed from request
        peak = max(peak, pods)
        frac = 1.0 if done < m.requests or rate == 0 else min(1.0, (step / rate) / dt)
        pod_seconds += pods * dt * frac
        now += dt * frac
        if now > 3 * m.window_s:
            break
    return Outcome(now, pod_seconds / 3600.0, peak, decisions)


def time_decisions(n: int, seed: int = 0) -> list[float]:
    """Per-call wall time (µs) of decide() on varied inputs, history filled to the window."""
    rng = random.Random(seed)
    m = Model()
    pols = policies(m)
    timings: list[float] = []
    hist: dict[str, RoleState] = {
        k: RoleState(tuple(Recommendation(-i * 60.0, 2 * rng.randint(1, 8)) for i in range(10, 0, -1)), 500.0)
        for k in pols}
    for i in range(n):
        now = float(i)
        left = rng.uniform(0, 1e6)
        work = RemainingWork(int(left), left * 1500, left * 300)
        for name, pol in pols.items():
            obs = RoleObservation(2 * rng.randint(1, 8), 2 * rng.randint(0, 8),
                                  rng.choice([None, rng.uniform(0, 5e4)]), rng.uniform(0, 300),
                                  rng.uniform(0, 300), rng.random())
            t0 = time.perf_counter_ns()
            d = decide(pol, work, obs, now, DAY, hist[name])
            timings.append((time.perf_counter_ns() - t0) / 1000.0)
            hist[name] = d.state if d.state.recommendations else hist[name]
    return timings


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1_000_000)
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--decisions", type=int, default=20_000)
    ap.add_argument("--max-replicas", type=int, default=16, help="per role (pods)")
    args = ap.parse_args(argv)

    timings = time_decisions(args.decisions // 2)
    print(f"decision time: {len(timings)} decide() calls: median {statistics.median(timings):.1f} µs, "
          f"p99 {pct(timings, 0.99):.1f} µs, max {max(timings):.1f} µs (target < 1000 µs)")

    m = Model(requests=args.requests)
    fixed = simulate(m, 0, autoscale=False, max_replicas=args.max_replicas)
    fixed_window_h = 2 * args.max_replicas * max(m.window_s, fixed.finish_s) / 3600.0
    rows = []
    for seed in range(args.seeds):
        auto = simulate(m, seed, autoscale=True, max_replicas=args.max_replicas)
        fix = simulate(m, seed, autoscale=False, max_replicas=args.max_replicas)
        rows.append((seed, auto, fix))
    late = [a.finish_s - m.window_s for _, a, _ in rows]
    auto_h = [a.gpu_hours for _, a, _ in rows]
    fix_h = [f.gpu_hours for _, _, f in rows]
    print(f"\nsimulated batch: {m.requests:,} requests, window {m.window_s / 3600:.0f} h, "
          f"{args.seeds} noise seeds, max {args.max_replicas} pods per role")
    print(f"{'deployment':<46} {'GPU-hours (median / worst)':>28} {'finish h (median / worst)':>28}")
    print(f"{'fixed max-size, held for the window (baseline)':<46} {fixed_window_h:>28.1f} "
          f"{m.window_s / 3600:>28.1f}")
    print(f"{'fixed max-size, torn down when done (oracle)':<46} "
          f"{statistics.median(fix_h):>14.1f} / {max(fix_h):<11.1f} "
          f"{statistics.median([f.finish_s for *_, f in rows]) / 3600:>14.2f} / "
          f"{max(f.finish_s for *_, f in rows) / 3600:<11.2f}")
    print(f"{'autoscaled by the policy (every 60 s)':<46} "
          f"{statistics.median(auto_h):>14.1f} / {max(auto_h):<11.1f} "
          f"{statistics.median([a.finish_s for _, a, _ in rows]) / 3600:>14.2f} / "
          f"{max(a.finish_s for _, a, _ in rows) / 3600:<11.2f}")
    wins = sum(a.gpu_hours < f.gpu_hours for _, a, f in rows)
    print(f"autoscaled used fewer GPU-hours than the torn-down fixed deployment on {wins}/{len(rows)} seeds")
    worst = max(late)
    print(f"worst-case lateness over {args.seeds} seeds: {max(worst, 0.0):.0f} s "
          f"(latest finish {worst:+.0f} s vs the deadline); peak pods {max(a.peak_pods for _, a, _ in rows)}")
    return {"median_us": statistics.median(timings), "p99_us": pct(timings, 0.99),
            "fixed_window_gpu_h": fixed_window_h, "auto_gpu_h_worst": max(auto_h),
            "fixed_done_gpu_h_median": statistics.median(fix_h), "worst_lateness_s": worst,
            "wins_vs_torn_down": wins}


if __name__ == "__main__":
    main()
