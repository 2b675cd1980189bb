"""The HTML report of a log: one self-contained page (inline CSS and SVG, no script, no network).

It shows the summary (score and interval, pass@k, latency percentiles, tokens, errors), a bar
chart of the score by tag, a latency histogram and the samples (failures first, with what was
expected and the scorer's explanation). Every text from the log is HTML-escaped: answers are
model output and must never become markup. A log may be hostile, so a transcript link is kept
only when it is a plain file name under the log's own transcript folder (`<log>.transcripts/`),
and dropped otherwise (never a `javascript:` or outside URL). This module only builds strings;
`write_report` is the one place that writes a file.
"""

from __future__ import annotations

import datetime
import html
import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

from treadle.evals.log import EvalLog, SampleRecord, read_log
from treadle.evals.summary import Summary, TagSummary, summarize

__all__ = ["MAX_REPORT_ROWS", "render_report", "transcript_href", "write_report"]

#: Samples listed in the report's table (failures first); the log holds every one.
MAX_REPORT_ROWS = 2000
_BINS = 20
_ANSWER_CHARS = 160
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#1d2330;
background:#f6f7f9}
main{max-width:1100px;margin:0 auto;padding:24px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 10px}
.meta{color:#5b6475;font-size:12px}
.cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(190px,1fr));gap:12px}
.card{background:#fff;border:1px solid #dde1e8;border-radius:8px;padding:12px}
.card b{display:block;font-size:20px}.card span{color:#5b6475;font-size:12px}
table{border-collapse:collapse;width:100%;background:#fff;font-size:13px}
th,td{border-bottom:1px solid #e4e7ec;padding:5px 8px;text-align:left;vertical-align:top}
th{background:#eef0f4}td.num{text-align:right;font-variant-numeric:tabular-nums}
.fail{color:#b42318}.pass{color:#067647}
svg{background:#fff;border:1px solid #dde1e8;border-radius:8px}
svg text{font:12px system-ui,sans-serif;fill:#1d2330}
.answer{font-family:ui-monospace,Menlo,monospace;font-size:12px;white-space:pre-wrap}
"""


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _card(title: str, value: str, note: str = "") -> str:
    return (
        f'<div class="card"><span>{_e(title)}</span><b>{_e(value)}</b><span>{_e(note)}</span></div>'
    )


def _cards(summary: Summary) -> str:
    s = summary.score
    method = "Wilson over items" if s.method == "wilson" else "t over item means"
    cards = [
        _card(
            "Score", f"{s.estimate:.3f}", f"{s.level:.0%} CI [{s.low:.3f}, {s.high:.3f}] ({method})"
        ),
        _card(
            "Pass rate",
            f"{summary.pass_rate:.1%}",
            f"{summary.samples} samples, {summary.items} items",
        ),
    ]
    cards += [
        _card(f"pass@{k}", f"{v:.3f}", "unbiased estimator") for k, v in summary.pass_at_k.items()
    ]
    lat = summary.latency
    cards.append(
        _card(
            "Latency p50", f"{lat['p50']:.3f} s", f"p95 {lat['p95']:.3f} s, p99 {lat['p99']:.3f} s"
        )
    )
    tokens = summary.tokens
    cards.append(
        _card(
            "Tokens",
            f"{tokens['total_tokens']:,}",
            f"{tokens['prompt_tokens']:,} prompt, "
            f"{tokens['completion_tokens']:,} completion, {tokens['requests']:,} requests",
        )
    )
    errors = sum(summary.errors.values())
    cards.append(_card("Errors", str(errors), f"{summary.retries} retries"))
    return '<div class="cards">' + "".join(cards) + "</div>"


def tag_chart(tags: Mapping[str, TagSummary]) -> str:
    """A horizontal bar chart (SVG) of the mean score per tag."""
    row, left, width = 26, 180, 520
    height = 30 + row * len(tags)
    parts = [
        f'<svg role="img" aria-label="Score by tag" width="{left + width + 90}" '
        f'height="{height}" viewBox="0 0 {left + width + 90} {height}" '
        'xmlns="http://www.w3.org/2000/svg">'
    ]
    for tick in (0.0, 0.25, 0.5, 0.75, 1.0):
        x = left + tick * width
        parts.append(
            f'<line x1="{x:.1f}" y1="8" x2="{x:.1f}" y2="{height - 18}" stroke="#e4e7ec"/>'
        )
        parts.append(f'<text x="{x:.1f}" y="{height - 4}" text-anchor="middle">{tick:g}</text>')
    for i, (tag, stats) in enumerate(tags.items()):
        y = 10 + i * row
        bar = max(stats.mean_score * width, 0.5)
        label = tag if len(tag) <= 24 else tag[:23] + "…"
        parts.append(f'<text x="{left - 8}" y="{y + 14}" text-anchor="end">{_e(label)}</text>')
        parts.append(
            f'<rect class="bar" x="{left}" y="{y}" width="{bar:.1f}" height="{row - 8}" '
            f'fill="#3b6fd8"><title>{_e(tag)}: {stats.mean_score:.3f} over {stats.samples} '
            "samples</title></rect>"
        )
        parts.append(
            f'<text x="{left + bar + 6:.1f}" y="{y + 14}">{stats.mean_score:.2f} '
            f"(n={stats.samples})</text>"
        )
    parts.append("</svg>")
    return "".join(parts)


def latency_histogram(latencies: Sequence[float], bins: int = _BINS) -> str:
    """A histogram (SVG) of sample latencies in `bins` equal-width bins."""
    low, high = min(latencies), max(latencies)
    span = high - low or 1e-9
    counts = [0] * bins
    for value in latencies:
        counts[min(int((value - low) / span * bins), bins - 1)] += 1
    width, height, left, bottom = 640, 220, 50, 30
    plot_w, plot_h = width - left - 10, height - bottom - 10
    peak = max(counts)
    parts = [
        f'<svg role="img" aria-label="Latency histogram" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg">',
        f'<line x1="{left}" y1="{10 + plot_h}" x2="{width - 10}" y2="{10 + plot_h}" '
        'stroke="#8a93a5"/>',
        f'<text x="{left - 6}" y="18" text-anchor="end">{peak}</text>',
        f'<text x="{left - 6}" y="{10 + plot_h}" text-anchor="end">0</text>',
    ]
    bar_w = plot_w / bins
    for i, count in enumerate(counts):
        h = plot_h * count / peak if peak else 0
        start = low + span * i / bins
        parts.append(
            f'<rect class="bar" x="{left + i * bar_w + 1:.1f}" y="{10 + plot_h - h:.1f}" '
            f'width="{bar_w - 2:.1f}" height="{h:.1f}" fill="#3b6fd8"><title>'
            f"{start:.3f}-{start + span / bins:.3f} s: {count}</title></rect>"
        )
    for frac, anchor in ((0.0, "start"), (0.5, "middle"), (1.0, "end")):
        x = left + frac * plot_w
        parts.append(
            f'<text x="{x:.1f}" y="{height - 8}" text-anchor="{anchor}">'
            f"{low + span * frac:.3f} s</text>"
        )
    parts.append("</svg>")
    return "".join(parts)


def transcript_href(transcript: str | None, log_name: str) -> str | None:
    """The link to a sample's transcript, relative to the log's folder, or None when the log's
    path is not a plain file name in `<log_name>.transcripts/`."""
    if not transcript:
        return None
    folder, _, name = transcript.partition("/")
    if folder != f"{log_name}.transcripts" or not _FILE_NAME.fullmatch(name) or ".." in name:
        return None
    return quote(f"{folder}/{name}")


def _short(text: str) -> str:
    return text if len(text) <= _ANSWER_CHARS else text[:_ANSWER_CHARS] + "…"


def _expected(value: Any) -> str:
    if value is None:
        return ""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _rows(records: Sequence[SampleRecord], log_name: str) -> str:
    ordered = sorted(records, key=lambda r: (r.passed, r.score, r.item_id, r.sample))
    shown = ordered[:MAX_REPORT_ROWS]
    out = [
        "<table><thead><tr><th>item</th><th>sample</th><th>score</th><th>passed</th>"
        "<th>latency</th><th>retries</th><th>error</th><th>answer</th><th>expected</th>"
        "<th>explanation</th><th>transcript</th></tr></thead><tbody>"
    ]
    for r in shown:
        href = transcript_href(r.transcript, log_name)
        link = f'<a href="{_e(href)}">jsonl</a>' if href else ""
        status = '<td class="pass">yes</td>' if r.passed else '<td class="fail">no</td>'
        error = _e(r.error_kind or "")
        why = r.explanation or r.error or ""
        out.append(
            f"<tr><td>{_e(r.item_id)}</td><td class=num>{r.sample}</td>"
            f"<td class=num>{r.score:.3f}</td>{status}<td class=num>{r.latency_s:.3f}</td>"
            f'<td class=num>{r.retries}</td><td title="{_e(r.error or "")}">{error}</td>'
            f'<td class="answer">{_e(_short(r.answer or ""))}</td>'
            f'<td class="answer">{_e(_short(_expected(r.expected)))}</td>'
            f"<td>{_e(_short(why))}</td><td>{link}</td></tr>"
        )
    out.append("</tbody></table>")
    if len(ordered) > len(shown):
        out.append(
            f'<p class="meta">{len(shown)} of {len(ordered)} samples shown (failures first).</p>'
        )
    return "".join(out)


def render_report(log: EvalLog, summary: Summary | None = None) -> str:
    """The report of `log` as one HTML document."""
    summary = summary or summarize(log)
    header = log.header
    agent = header.config.get("agent", {})
    model = (agent.get("provider") or {}).get("model") if isinstance(agent, dict) else None
    created = datetime.datetime.fromtimestamp(header.created_at, datetime.UTC)
    title = f"Evaluation: {header.dataset}"
    meta = (
        f"agent {agent.get('name') or agent.get('callable', '?')}"
        + (f", model {model}" if model else "")
        + f" · {header.items} items x {header.samples} samples · started "
        f"{created:%Y-%m-%d %H:%M} UTC · config {header.config_hash[:12]}"
        f" · treadle {header.treadle}"
    )
    errors = "".join(
        f"<tr><td>{_e(kind)}</td><td class=num>{count}</td></tr>"
        for kind, count in summary.errors.items()
    )
    error_table = (
        f"<h2>Errors</h2><table><tr><th>kind</th><th>samples</th></tr>{errors}</table>"
        if errors
        else ""
    )
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width,initial-scale=1">'
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body><main>"
        f"<h1>{_e(title)}</h1><p class=meta>{_e(meta)}</p>"
        f"{_cards(summary)}"
        f"<h2>Score by tag</h2>{tag_chart(summary.by_tag)}"
        f"<h2>Latency</h2>{latency_histogram([r.latency_s for r in log.records])}"
        f"{error_table}<h2>Samples</h2>{_rows(log.records, log.path.name)}"
        "</main></body></html>\n"
    )


def write_report(
    log: str | os.PathLike[str] | EvalLog, out: str | os.PathLike[str] | None = None
) -> Path:
    """Write the report of `log` to `out` (default: the log's path with `.html`); return it.

    The default place keeps the transcript links (relative to the log) working.
    """
    read = log if isinstance(log, EvalLog) else read_log(log)
    target = Path(out) if out is not None else read.path.with_suffix(".html")
    target.write_text(render_report(read), encoding="utf-8")
    return target
