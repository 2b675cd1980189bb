"""Writing results: JSON (everything), Markdown (the tables and targets) and a PNG plot.

The plot needs matplotlib (the `bench` extra, installed by `make bench`); without it the PNG is
skipped with a message. This module must never measure anything.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.scenarios import Result, finite


def _fmt(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if not finite(value):
        return "n/a"
    if isinstance(value, int) or (float(value).is_integer() and abs(value) >= 100):
        return f"{int(value):,}"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def markdown(results: list[Result], meta: dict[str, Any]) -> str:
    """The results as Markdown: one table per scenario, then the targets."""
    lines = [
        f"Run: {meta['date']}, size `{meta['size']}`, Python {meta['python']}, "
        f"{meta['cpus']} CPUs, client/server pinned: {meta['pinned']}.",
        "",
    ]
    for r in results:
        lines += [
            f"### {r.title}",
            "",
            "| | " + " | ".join(r.columns) + " |",
            "|---|" + "---:|" * len(r.columns),
        ]
        for row in r.rows:
            cells = [_fmt(row.get(c, "")) for c in r.columns]
            lines.append(f"| {row['label']} | " + " | ".join(cells) + " |")
        lines += [""] + [f"- {note}" for note in r.notes] + ([""] if r.notes else [])
    lines += ["### Targets", "", "| target | value | goal | result |", "|---|---:|---|---|"]
    for r in results:
        for t in r.targets:
            lines.append(
                f"| {t.name} | {_fmt(t.value)} | {t.goal} | {'PASS' if t.passed else 'FAIL'} |"
            )
    if meta.get("notes"):
        lines += ["", "Notes:", ""] + [f"- {n}" for n in meta["notes"]]
    return "\n".join(lines) + "\n"


def write_json(path: Path, results: list[Result], meta: dict[str, Any]) -> None:
    """Everything, including per-round curves."""
    path.write_text(
        json.dumps({"meta": meta, "scenarios": [asdict(r) for r in results]}, indent=1, default=str)
    )


def plot(path: Path, results: list[Result]) -> str | None:
    """Draw the PNG; returns why it was skipped, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]'); no PNG written"
    by_key = {r.key: r for r in results}
    fig, axes = plt.subplots(3, 2, figsize=(12, 12))
    panels = [
        ("s1", axes[0][0], "CPU µs per round (S1, lower is better)", False),
        ("s2", axes[0][1], "fan-out wall s (S2, lower is better)", False),
        ("s3", axes[1][0], "CPU µs per round along a long pass (S3)", True),
        ("s4", axes[1][1], "ms per round, 8 x 100 ms tools (S4)", False),
        ("s7", axes[2][0], "rate-limited goodput: x the limit-bound ideal (S7)", False),
    ]
    axes[2][1].axis("off")
    for key, ax, title, is_curve in panels:
        ax.set_title(title, fontsize=10)
        r = by_key.get(key)
        if r is None:
            ax.axis("off")
            continue
        if is_curve:
            for label, curve in r.series.items():
                ax.plot(range(1, len(curve) + 1), curve, label=label, linewidth=1)
            ax.set_xlabel("tool round")
            ax.legend(fontsize=8)
            continue
        labels = list(r.series)
        values = [float(r.series[k]) for k in labels]
        colors = ["#d9822b" if k.startswith("treadle") else "#4a7ab5" for k in labels]
        ax.barh(range(len(labels)), values, color=colors)
        ax.set_yticks(range(len(labels)), labels, fontsize=8)
        ax.invert_yaxis()
        for i, v in enumerate(values):
            ax.text(v, i, f" {_fmt(v)}", va="center", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return None
