"""The night's report: one self-contained HTML page (trend plot inlined as a PNG data URI) and
the same content as Markdown. Pure Python + matplotlib (Agg), no Airflow."""

from __future__ import annotations

import base64
import html
import io
from dataclasses import dataclass, field
from typing import Any

from aibrix_operators.batch.cost import describe as describe_cost
from aibrix_operators.evaluation.history import Night
from aibrix_operators.evaluation.scoring import ItemResult
from aibrix_operators.evaluation.stats import Comparison, Interval


@dataclass
class ReportData:
    suite: str
    date: str
    model: str
    scorer: str
    interval: Interval
    comparisons: list[Comparison]
    history: list[Night]
    regressed_items: list[dict[str, Any]] = field(default_factory=list)
    failed_requests: int = 0
    max_drop: float = 0.0
    min_score: float | None = None
    # The night's model and the LoRA adapters evaluated beside it, when the suite has adapters.
    models: list[ModelRow] = field(default_factory=list)
    # The night's batch: its usage (OpenAI's shape) and, with deployment prices, its cost line.
    usage: dict[str, Any] | None = None
    cost: dict[str, Any] | None = None

    @property
    def regression(self) -> bool:
        return any(c.regression for c in self.comparisons) or any(m.regression for m in self.models)


@dataclass
class ModelRow:
    """One model of a night with adapters: the side-by-side table's row."""

    model: str
    interval: Interval
    comparisons: list[Comparison]
    adapter: bool

    @property
    def regression(self) -> bool:
        return any(c.regression for c in self.comparisons)


def side_by_side(data: ReportData) -> list[dict[str, str]]:
    """Rows of the base-vs-adapters table: score and CI, the gain over the night's model and
    whether the two CIs are apart, and each model's own verdict."""
    if len(data.models) < 2:
        return []
    base = data.models[0].interval
    rows = []
    for m in data.models:
        iv = m.interval
        apart = iv.low > base.high or iv.high < base.low
        gain = "—" if not m.adapter else (f"{(iv.mean - base.mean) * 100:+.1f} pt "
                                          f"({'CIs apart' if apart else 'CIs overlap'})")
        vs = ", ".join(f"{c.against} {_delta(c)}" for c in m.comparisons) or "first night"
        rows.append({"model": m.model, "role": "adapter" if m.adapter else "model",
                     "score": _pct(iv.mean), "ci": f"[{_pct(iv.low)}, {_pct(iv.high)}]", "gain": gain,
                     "vs": vs, "verdict": "REGRESSION" if m.regression else "ok"})
    return rows


_SIDE_COLUMNS = ("model", "role", "score", "ci", "gain", "vs", "verdict")
_SIDE_HEADERS = ("model", "role", "score", "CI", "vs the model", "vs its own past", "verdict")


def regressed_items(tonight: list[ItemResult], previous: list[dict[str, Any]], limit: int = 20
                    ) -> list[dict[str, Any]]:
    """Items whose score fell since the previous night, largest fall first."""
    before = {r["id"]: r for r in previous}
    fallen = []
    for r in tonight:
        old = before.get(r.id)
        if old is not None and old["score"] > r.score:
            fallen.append({"id": r.id, "reference": r.reference, "before": old.get("answer"),
                           "now": r.answer, "drop": old["score"] - r.score, "error": r.error})
    fallen.sort(key=lambda x: (-x["drop"], x["id"]))
    return fallen[:limit]


def trend_png(history: list[Night], max_points: int = 400) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure  # the pyplot-free API: no global state, thread-safe

    nights = history[-max_points:]
    fig = Figure(figsize=(7, 2.6), dpi=100)
    ax = fig.add_subplot()
    xs = list(range(len(nights)))
    ax.fill_between(xs, [n.low for n in nights], [n.high for n in nights], alpha=0.25, color="tab:blue",
                    label="95% CI")
    ax.plot(xs, [n.score for n in nights], marker="o" if len(nights) < 40 else None, color="tab:blue",
            label="score")
    bad = [i for i, n in enumerate(nights) if n.regression]
    ax.scatter(bad, [nights[i].score for i in bad], color="tab:red", zorder=3, label="regression")
    step = max(1, len(nights) // 8)
    ax.set_xticks(xs[::step], [n.date for n in nights][::step], rotation=20, fontsize=7)
    ax.set_ylim(-0.02, 1.02)
    ax.set_ylabel("score")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _floor_note(data: ReportData) -> str:
    """The suite's informational floor (thresholds.min_score): not a regression rule."""
    if data.min_score is None:
        return ""
    below = data.interval.mean < data.min_score
    return f"Floor {_pct(data.min_score)}: {'BELOW' if below else 'met'}."


def _pct(x: float) -> str:
    return f"{x * 100:.1f}%"


def _delta(c: Comparison) -> str:
    return f"{c.delta * 100:+.1f} pt"


def render_markdown(data: ReportData) -> str:
    iv = data.interval
    verdict = "REGRESSION" if data.regression else "ok"
    lines = [f"# Eval `{data.suite}` — {data.date}", "",
             f"Model `{data.model}`, scorer `{data.scorer}`, {iv.n} items, "
             f"{data.failed_requests} without an answer. Verdict: **{verdict}**", "",
             *([f"The night's batch: {_spend(data)}", ""] if data.usage else []),
             "| score | 95% CI | vs | reference | delta | regression | why |",
             "|---|---|---|---|---|---|---|"]
    if not data.comparisons:
        lines.append(f"| {_pct(iv.mean)} | [{_pct(iv.low)}, {_pct(iv.high)}] | — | — | — | no "
                     "| first night |")
    for c in data.comparisons:
        lines.append(f"| {_pct(iv.mean)} | [{_pct(iv.low)}, {_pct(iv.high)}] | {c.against} "
                     f"({c.reference_date or '—'}) | {_pct(c.reference_score)} | {_delta(c)} | "
                     f"{'**yes**' if c.regression else 'no'} | {c.reason} |")
    side = side_by_side(data)
    if side:
        lines += ["", "## The model and its adapters", "", "| " + " | ".join(_SIDE_HEADERS) + " |",
                  "|" + "---|" * len(_SIDE_HEADERS)]
        lines += ["| " + " | ".join(row[k] for k in _SIDE_COLUMNS) + " |" for row in side]
    lines += ["", f"Regression rule: a drop of more than {data.max_drop * 100:.1f} pt that is also "
              f"outside tonight's confidence interval. {_floor_note(data)}".rstrip(), ""]
    if data.regressed_items:
        lines += ["## Top regressed items", "", "| id | reference | before | now |", "|---|---|---|---|"]
        for it in data.regressed_items:
            lines.append(f"| {it['id']} | {_md(it['reference'])} | {_md(it['before'])} | "
                         f"{_md(it['now'] if it['now'] is not None else it['error'])} |")
    lines += ["", "## Trend", "", "![trend](trend.png)", ""]
    return "\n".join(lines)


def _spend(data: ReportData) -> str:
    """The batch's tokens, and its cost where the deployment sets prices."""
    usage = data.usage or {}
    cached = (usage.get("input_tokens_details") or {}).get("cached_tokens", 0)
    tokens = (f"{usage.get('input_tokens', 0)} input tokens ({cached} cached), "
              f"{usage.get('output_tokens', 0)} output tokens")
    cost = describe_cost(data.cost)
    return f"{tokens}; cost {cost}" if cost else f"{tokens} (no prices set: no cost)"


def _md(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")[:120]


def _h(value: Any) -> str:
    return html.escape(str(value))


def render_html(data: ReportData, png: bytes) -> str:
    iv = data.interval
    verdict = "REGRESSION" if data.regression else "OK"
    rows = []
    for c in data.comparisons or [None]:
        if c is None:
            rows.append(f"<tr><td>{_pct(iv.mean)}</td><td>[{_pct(iv.low)}, {_pct(iv.high)}]</td>"
                        "<td>—</td><td>—</td><td>—</td><td>no</td><td>first night</td></tr>")
            continue
        cls = "bad" if c.regression else ("down" if c.delta < 0 else "up")
        rows.append(
            f"<tr class='{cls}'><td>{_pct(iv.mean)}</td><td>[{_pct(iv.low)}, {_pct(iv.high)}]</td>"
            f"<td>{_h(c.against)} ({_h(c.reference_date or '—')})</td><td>{_pct(c.reference_score)}</td>"
            f"<td>{_delta(c)}</td><td>{'yes' if c.regression else 'no'}</td><td>{_h(c.reason)}</td></tr>")
    items = "".join(
        f"<tr><td>{_h(it['id'])}</td><td>{_h(it['reference'])}</td><td>{_h(it['before'])}</td>"
        f"<td>{_h(it['now'] if it['now'] is not None else it['error'])}</td></tr>"
        for it in data.regressed_items)
    items_html = (f"<h2>Top regressed items</h2><table><tr><th>id</th><th>reference</th><th>before</th>"
                  f"<th>now</th></tr>{items}</table>") if items else ""
    side = side_by_side(data)
    side_html = ""
    if side:
        head = "".join(f"<th>{h}</th>" for h in _SIDE_HEADERS)
        body = "".join(
            f"<tr class='{'bad' if row['verdict'] != 'ok' else ''}'>"
            + "".join(f"<td>{_h(row[k])}</td>" for k in _SIDE_COLUMNS) + "</tr>" for row in side)
        side_html = f"<h2>The model and its adapters</h2><table><tr>{head}</tr>{body}</table>"
    img = base64.b64encode(png).decode()
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Eval {_h(data.suite)} {_h(data.date)}</title>
<style>
body{{font-family:system-ui,sans-serif;margin:2em;max-width:60em;color:#222}}
table{{border-collapse:collapse;margin:1em 0}}td,th{{border:1px solid #ccc;padding:.3em .6em;text-align:left}}
th{{background:#f3f3f3}}tr.bad td{{background:#fde2e2}}tr.up td{{background:#e6f6e6}}
.verdict{{font-weight:bold;padding:.2em .6em;border-radius:.3em}}
.v-OK{{background:#d8f0d8}}.v-REGRESSION{{background:#f7c6c6}}
</style></head><body>
<h1>Eval <code>{_h(data.suite)}</code> — {_h(data.date)}</h1>
<p>Model <code>{_h(data.model)}</code>, scorer <code>{_h(data.scorer)}</code>, {iv.n} items,
{data.failed_requests} without an answer. Verdict: <span class="verdict v-{verdict}">{verdict}</span></p>
{f"<p>The night's batch: {_h(_spend(data))}</p>" if data.usage else ""}
<table><tr><th>score</th><th>{iv.confidence:.0%} CI</th><th>vs</th><th>reference</th><th>delta</th>
<th>regression</th><th>why</th></tr>{''.join(rows)}</table>
{side_html}
<p>Regression rule: a drop of more than {data.max_drop * 100:.1f} pt that is also outside tonight's
confidence interval. {_h(_floor_note(data))}</p>
<h2>Trend</h2><img alt="score trend" src="data:image/png;base64,{img}">
{items_html}
</body></html>
"""
