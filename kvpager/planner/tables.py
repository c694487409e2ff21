"""Quick-reference tables (Markdown, CSV) and the capacity-versus-concurrency plot."""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass, replace

from kvpager.core.units import format_bytes
from kvpager.planner import kvmath
from kvpager.planner.devices import Device
from kvpager.planner.models import ModelFacts
from kvpager.planner.plan import Plan, PlanOptions, make_plan
from kvpager.planner.weights import parse_weight_format

DEFAULT_TABLE_FORMATS = ("bf16", "fp8", "q8_0", "q4_k_m")
COLUMNS = (
    "model",
    "weights",
    "weight_bytes",
    "fits",
    "max_context_tokens",
    "max_concurrency",
    "decode_tokens_per_s_bound",
)


@dataclass(frozen=True)
class TableRow:
    model: str
    weights: str
    weight_bytes: int
    fits: bool
    max_context_tokens: int | None
    max_concurrency: int | None
    decode_tokens_per_s_bound: float | None


def table_rows(models: list[ModelFacts], formats: list[str], options: PlanOptions, device: Device) -> list[TableRow]:
    """One row per (model, weight format) on one device."""
    rows = []
    for facts in models:
        for name in formats:
            plan = make_plan(facts, replace(options, weights=parse_weight_format(name)), device)
            rows.append(_row(plan))
    return rows


def _row(plan: Plan) -> TableRow:
    fits = bool(plan.fits)
    return TableRow(
        model=plan.model,
        weights=plan.weight_format,
        weight_bytes=plan.weight_bytes,
        fits=fits,
        max_context_tokens=plan.max_context_tokens if fits else None,
        max_concurrency=plan.max_concurrency if fits else None,
        decode_tokens_per_s_bound=plan.decode_tokens_per_s_bound if fits else None,
    )


def render_markdown(rows: list[TableRow], device: Device, context: int) -> str:
    head = f"| Model | Weights | Size | Fits on {device.name} | Max context | Sequences at {context:,} | Decode tok/s ≤ (batch 1) |"
    lines = [head, "|---|---|---:|:---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r.model} | {r.weights} | {format_bytes(r.weight_bytes)} | {'yes' if r.fits else 'no'} | {_cell(r.max_context_tokens)}"
            f" | {_cell(r.max_concurrency)} | {_cell(r.decode_tokens_per_s_bound, '{:,.0f}')} |"
        )
    return "\n".join(lines) + "\n"


def render_csv(rows: list[TableRow]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(COLUMNS)
    for r in rows:
        rate = None if r.decode_tokens_per_s_bound is None else round(r.decode_tokens_per_s_bound, 2)
        writer.writerow(
            [
                r.model,
                r.weights,
                r.weight_bytes,
                r.fits,
                _blank(r.max_context_tokens),
                _blank(r.max_concurrency),
                _blank(rate),
            ]
        )
    return out.getvalue()


def _cell(value: float | None, fmt: str = "{:,}") -> str:
    return "—" if value is None else fmt.format(value)


def _blank(value: object) -> object:
    return "" if value is None else value


def capacity_curve(
    plan: Plan, facts: ModelFacts, kv_dtype_bytes: int, max_sequences: int = 64
) -> list[tuple[int, int]]:
    """(concurrent sequences, longest context each can hold) for 1..max_sequences, capped at max_model_len."""
    points: list[tuple[int, int]] = []
    if not plan.usable_kv_bytes or plan.usable_kv_bytes <= 0:
        return points
    for sequences in range(1, max_sequences + 1):
        per_seq = kvmath.max_context_by_memory(facts, kv_dtype_bytes, plan.usable_kv_bytes // sequences)
        tokens = plan.max_model_len if per_seq is None else min(per_seq, plan.max_model_len)
        if tokens > 0:
            points.append((sequences, tokens))
    return points


def save_plot(curves: dict[str, list[tuple[int, int]]], path: str, title: str) -> None:
    """Draw context capacity versus concurrency; ValueError when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ValueError("--plot needs matplotlib: pip install 'kvpager[plot]' (or pip install matplotlib)") from exc
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, points in curves.items():
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("concurrent sequences")
    ax.set_ylabel("max context per sequence (tokens)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
