"""The report's plots, drawn by matplotlib (the `plot` extra) into PNG bytes that report.py
embeds (base64), so the HTML file needs nothing at view time. Each function returns None
when the run recorded nothing to draw."""

from __future__ import annotations

import base64
import io
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after the backend is chosen

COLORS = {"data": "#e6a23c", "compute": "#409eff", "comm": "#f56c6c", "checkpoint": "#909399", "eval": "#67c23a",
          "log": "#b37feb"}
STATE_COLORS = {"finished": "#67c23a", "running": "#409eff", "failed": "#f56c6c", "lost": "#f56c6c",
                "preempted": "#e6a23c"}


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def attempts(rows: list[dict[str, Any]]) -> str | None:
    """rows: {label, start, end (seconds from the run's first record), state, world}."""
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(9, 0.6 + 0.45 * len(rows)))
    for y, a in enumerate(rows):
        ax.barh(y, max(a["end"] - a["start"], 0.01), left=a["start"], color=STATE_COLORS.get(a["state"], "#999"))
        ax.text(a["start"], y, f"  {a['world']} rank(s), {a['state']}", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [a["label"] for a in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the run's first record")
    ax.set_title("attempts (launches and restarts)")
    return _png(fig)


def curves(train: list[tuple[int, float, int]], val: list[tuple[int, float]]) -> str | None:
    """train: (step, loss, attempt); val: (step, loss)."""
    if not train and not val:
        return None
    fig, ax = plt.subplots(figsize=(9, 3.2))
    for attempt in sorted({a for _, _, a in train}):
        pts = [(s, v) for s, v, a in train if a == attempt]
        ax.plot(*zip(*pts), marker=".", ms=3, lw=1, label=f"train loss (attempt {attempt})")
    if val:
        ax.plot(*zip(*val), marker="o", lw=1.5, color="black", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend(fontsize=8)
    ax.set_title("loss")
    return _png(fig)


def throughput(rows: list[tuple[int, float | None, float | None]]) -> str | None:
    """rows: (step, tokens/s, MFU)."""
    tok = [(s, t) for s, t, _ in rows if t is not None]
    mfu = [(s, m * 100) for s, _, m in rows if m is not None]
    if not tok and not mfu:
        return None
    fig, axes = plt.subplots(2, 1, figsize=(9, 4.4), sharex=True)
    for ax, pts, label, color in ((axes[0], tok, "tokens/s", "#409eff"), (axes[1], mfu, "MFU (%)", "#f56c6c")):
        if pts:
            ax.plot(*zip(*pts), color=color, marker=".", lw=1)
        ax.set_ylabel(label)
    axes[1].set_xlabel("step")
    axes[0].set_title("throughput and MFU per step")
    return _png(fig)


def time_split(per_rank: dict[int, dict[str, float]], title: str) -> str | None:
    """per_rank: rank -> mean seconds per step by part."""
    if not per_rank:
        return None
    ranks = sorted(per_rank)
    fig, ax = plt.subplots(figsize=(9, 0.8 + 0.45 * len(ranks)))
    left = [0.0] * len(ranks)
    for part, color in COLORS.items():
        widths = [per_rank[r].get(part, 0.0) * 1000 for r in ranks]
        ax.barh(range(len(ranks)), widths, left=left, color=color, label=part)
        left = [a + b for a, b in zip(left, widths)]
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("ms per step (mean)")
    ax.legend(fontsize=8, ncol=len(COLORS), loc="lower center", bbox_to_anchor=(0.5, 1.0))
    ax.set_title(title, pad=24)
    return _png(fig)


def busy_per_step(series: dict[int, list[tuple[int, float]]]) -> str | None:
    """series: rank -> (step, busy ms)."""
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(9, 3.0))
    for r, pts in sorted(series.items()):
        if pts:
            ax.plot(*zip(*pts), marker=".", lw=1, label=f"rank {r}")
    ax.set_xlabel("step")
    ax.set_ylabel("busy ms (data wait + compute)")
    ax.legend(fontsize=8)
    ax.set_title("each rank's busy time per step: the highest is the one the others wait for")
    return _png(fig)


def memory(breakdowns: list[dict[str, Any]]) -> str | None:
    """breakdowns: per rank metrics.json's peak_breakdown (phase_peaks, parts)."""
    if not breakdowns:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.2))
    phases = sorted({p for b in breakdowns for p in b.get("phase_peaks", {})})
    width = 0.8 / max(1, len(breakdowns))
    for r, b in enumerate(breakdowns):
        ax1.bar([i + r * width for i in range(len(phases))], [b["phase_peaks"].get(p, 0) / 2**20 for p in phases],
                width, label=f"rank {r}")
    ax1.set_xticks([i + 0.4 - width / 2 for i in range(len(phases))], phases, rotation=30, fontsize=8)
    ax1.set_ylabel("MiB")
    ax1.set_title("peak live tensors by phase", fontsize=10)
    ax1.legend(fontsize=7)
    parts = sorted({p for b in breakdowns for p, v in b.get("parts", {}).items() if v})
    bottom = [0.0] * len(breakdowns)
    for p in parts:
        h = [b.get("parts", {}).get(p, 0) / 2**20 for b in breakdowns]
        ax2.bar(range(len(breakdowns)), h, bottom=bottom, label=p)
        bottom = [a + c for a, c in zip(bottom, h)]
    ax2.set_xticks(range(len(breakdowns)), [f"rank {r}" for r in range(len(breakdowns))])
    ax2.set_title("at each rank's peak, by part", fontsize=10)
    ax2.legend(fontsize=7)
    return _png(fig)


def collectives(rows: list[dict[str, Any]]) -> str | None:
    """rows: {kind, bytes, theory_bytes, seconds, theory_s} per step."""
    if not rows:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.2))
    kinds = [r["kind"] for r in rows]
    x = range(len(rows))
    ax1.bar([i - 0.2 for i in x], [r["bytes"] / 2**10 for r in rows], 0.4, label="measured")
    ax1.bar([i + 0.2 for i in x], [(r["theory_bytes"] or 0) / 2**10 for r in rows], 0.4, label="theory")
    ax1.set_xticks(list(x), kinds, rotation=20, fontsize=8)
    ax1.set_ylabel("KiB per step (rank 0)")
    ax1.legend(fontsize=8)
    ax2.bar([i - 0.2 for i in x], [r["seconds"] * 1000 for r in rows], 0.4, label="measured (issue to completion)")
    ax2.bar([i + 0.2 for i in x], [(r["theory_s"] or 0) * 1000 for r in rows], 0.4, label="theory (alpha-beta)")
    ax2.set_xticks(list(x), kinds, rotation=20, fontsize=8)
    ax2.set_ylabel("ms per step (rank 0)")
    ax2.legend(fontsize=7)
    fig.suptitle("collectives per step, by kind", fontsize=10)
    return _png(fig)
