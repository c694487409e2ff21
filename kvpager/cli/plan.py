"""`kvpager plan`: will it fit, how much context, how fast — before you buy.

`main(argv)` returns an exit status: 0 fine, 1 the model does not fit, 2 bad input. Errors are one
clear line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from kvpager.core.config import QUANTIZATIONS, resolve_dtype
from kvpager.core.units import format_bytes, parse_bytes, parse_reserve
from kvpager.gguf import hf_config_from_gguf, is_gguf_path, open_gguf
from kvpager.planner.devices import Device, custom_device, custom_reserve, find_device, measure_cpu
from kvpager.planner.kvmath import parse_kv_dtype
from kvpager.planner.models import ModelFacts, load_model_facts, shipped_model_names
from kvpager.planner.plan import Plan, PlanOptions, make_plan
from kvpager.planner.report import render_text
from kvpager.planner.tables import (
    DEFAULT_TABLE_FORMATS,
    capacity_curve,
    render_csv,
    render_markdown,
    save_plot,
    table_rows,
)
from kvpager.planner.weights import WEIGHT_FORMATS, parse_weight_format

EXIT_DOES_NOT_FIT = 1
EXIT_BAD_INPUT = 2


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, so main() reports every error the same way."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ValueError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="kvpager plan",
        description="Capacity planner: weights, KV cache, context, concurrency and decode-speed bounds.",
    )
    p.add_argument("model", nargs="?", help="model directory, config.json, or a known model name (e.g. Llama-3.1-8B)")
    p.add_argument(
        "--device", help="a known GPU or Apple chip (e.g. RTX-4090, M3-Max-64GB), or 'cpu' to measure this machine"
    )
    p.add_argument("--memory", help="custom device memory, e.g. 6GiB (with --bandwidth)")
    p.add_argument("--bandwidth", help="custom device memory bandwidth, e.g. 192GB/s")
    p.add_argument(
        "--weights",
        help=f"weight format: {', '.join(WEIGHT_FORMATS)} (comma list with --table); default: checkpoint bytes or bf16",
    )
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="kvpager's compute dtype: exact engine weight bytes (auto: the checkpoint's torch_dtype, as serve)",
    )
    p.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        help="kvpager's weight quantization (as `kvpager serve`): exact engine weight bytes",
    )
    p.add_argument("--quantization-group-size", type=int, help="as `kvpager serve` (int4 default 128)")
    p.add_argument(
        "--quantize-lm-head",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="as `kvpager serve`: with --quantization the lm_head is int8 per output channel (tied embeddings: "
        "an int8 copy beside the table); --no-quantize-lm-head counts it in --dtype",
    )
    p.add_argument(
        "--gguf-int8-activations",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="as `kvpager serve` (on by default for a GGUF file on the CPU): the forms the file's blocks are held "
        "in, and a tied lm_head's packed copy of the embedding's blocks, counted here",
    )
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="as `kvpager serve`: the engine_* block count is one rank's pool (--kv-cache-memory per rank)",
    )
    p.add_argument(
        "--kv-dtype", default="bf16", help="KV cache element type: fp32, fp16, bf16, fp8, int8 (default bf16)"
    )
    p.add_argument(
        "--context",
        type=int,
        default=8192,
        help="tokens per sequence for concurrency and decode answers (default 8192)",
    )
    p.add_argument("--batch", type=int, default=16, help="batch size for the batched decode bound (default 16)")
    p.add_argument("--prompt", type=int, help="prompt tokens n for the attention-pair count (with --generate)")
    p.add_argument("--generate", type=int, help="generated tokens m for the attention-pair count (with --prompt)")
    p.add_argument(
        "--reserve",
        help="memory kept back for runtime/activations: bytes (2GiB) or a share (15%%); default 10%% + 1 GiB (Apple: 25%%)",
    )
    p.add_argument("--block-size", type=int, default=16, help="KV block size in tokens (default 16, as the engine)")
    p.add_argument(
        "--kv-cache-memory", help="an engine KV budget (e.g. 512MiB): plan reports the engine's exact block count"
    )
    p.add_argument(
        "--max-model-len", type=int, help="longest sequence allowed (default: the model's max_position_embeddings)"
    )
    p.add_argument("--json", action="store_true", help="print the answers as JSON")
    p.add_argument(
        "--table", action="store_true", help="Markdown quick reference: models × weight formats on one device"
    )
    p.add_argument("--csv", action="store_true", help="the quick reference as CSV")
    p.add_argument("--plot", metavar="PNG", help="draw context capacity versus concurrency (needs matplotlib)")
    p.add_argument("--models", help="comma-separated models for --table/--csv/--plot (default: every known model)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of `kvpager plan`; returns the exit status."""
    try:
        args = build_parser().parse_args(argv)
        return _run(args)
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0
    except ValueError as exc:
        print(f"kvpager plan: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _run(args: argparse.Namespace) -> int:
    device = _device(args)
    options = _options(args, device)
    if args.table or args.csv or args.plot:
        return _run_tables(args, options, device)
    if args.model is None:
        raise ValueError("give a MODEL (directory, config.json or a known name such as Llama-3.1-8B), or --table")
    if args.weights and "," in args.weights:
        raise ValueError("--weights takes one format for a single plan; comma lists are for --table/--csv")
    facts = load_model_facts(args.model)
    model_dir = Path(args.model) if Path(args.model).is_dir() or is_gguf_path(args.model) else None
    plan = make_plan(facts, options, device, model_dir)
    print(json.dumps(plan.to_json(), indent=2) if args.json else render_text(plan), end="" if not args.json else "\n")
    if plan.fits is False:
        print(f"kvpager plan: error: {_does_not_fit(plan, facts, options, device)}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    return 0


def _device(args: argparse.Namespace) -> Device | None:
    if args.device and args.memory:
        raise ValueError("give either --device or --memory/--bandwidth, not both")
    if args.memory:
        return custom_device(args.memory, args.bandwidth)
    if args.bandwidth:
        raise ValueError("--bandwidth needs --memory too (e.g. --memory 6GiB --bandwidth 192GB/s)")
    if args.device is None:
        return None
    return measure_cpu() if args.device.lower() == "cpu" else find_device(args.device)


def _options(args: argparse.Namespace, device: Device | None) -> PlanOptions:
    reserve = None
    if args.reserve is not None:
        if device is None:
            raise ValueError("--reserve needs a device (--device or --memory/--bandwidth)")
        reserve = custom_reserve(device, *parse_reserve(args.reserve))
        if reserve.num_bytes >= device.memory_bytes:
            raise ValueError(
                f"--reserve {args.reserve} is not less than the device memory {format_bytes(device.memory_bytes)}"
            )
    single = args.weights if args.weights and "," not in args.weights else None
    return PlanOptions(
        weights=parse_weight_format(single) if single else None,
        kv_dtype=args.kv_dtype,
        context=args.context,
        batch=args.batch,
        num_prompt_tokens=args.prompt,
        num_generated_tokens=args.generate,
        block_size=args.block_size,
        kv_cache_memory=parse_bytes(args.kv_cache_memory, what="--kv-cache-memory") if args.kv_cache_memory else None,
        max_model_len=args.max_model_len,
        reserve=reserve,
        dtype=_engine_dtype(args),
        quantization=args.quantization,
        quantization_group_size=args.quantization_group_size,
        quantize_lm_head=args.quantize_lm_head,
        gguf_int8_activations=args.gguf_int8_activations,
        tensor_parallel_size=args.tensor_parallel_size,
    )


def _engine_dtype(args: argparse.Namespace) -> str | None:
    """--dtype as the engine resolves it ("auto": the checkpoint's torch_dtype on CPU); None when unset."""
    if args.dtype is None:
        return "bfloat16" if args.quantization else None
    if args.dtype != "auto":
        return str(args.dtype)
    config = Path(args.model) / "config.json" if args.model else None
    torch_dtype = "bfloat16"
    if args.model and is_gguf_path(args.model):
        torch_dtype = str(hf_config_from_gguf(open_gguf(args.model))["torch_dtype"])
    elif config is not None and config.is_file():
        data = json.loads(config.read_text(encoding="utf-8"))
        torch_dtype = str(data.get("torch_dtype") or data.get("dtype") or "float32")
    return resolve_dtype("auto", torch_dtype, "cpu")


def _run_tables(args: argparse.Namespace, options: PlanOptions, device: Device | None) -> int:
    if device is None:
        raise ValueError("--table, --csv and --plot need a device: --device NAME, --device cpu or --memory/--bandwidth")
    names = (
        [m.strip() for m in args.models.split(",") if m.strip()]
        if args.models
        else ([args.model] if args.model else shipped_model_names())
    )
    models = [load_model_facts(name) for name in names]
    formats = [f.strip() for f in args.weights.split(",")] if args.weights else list(DEFAULT_TABLE_FORMATS)
    for name in formats:
        parse_weight_format(name)  # fail early on a typo
    if args.table or args.csv:
        rows = table_rows(models, formats, options, device)
        print(render_csv(rows) if args.csv else render_markdown(rows, device, options.context), end="")
    if args.plot:
        _plot(args.plot, models, formats[0], options, device)
    return 0


def _plot(path: str, models: list[ModelFacts], fmt: str, options: PlanOptions, device: Device) -> None:
    _, kv_bytes = parse_kv_dtype(options.kv_dtype)
    curves = {}
    for facts in models:
        plan = make_plan(facts, replace(options, weights=parse_weight_format(fmt)), device)
        curves[f"{facts.name} ({fmt})"] = capacity_curve(plan, facts, kv_bytes)
    save_plot(curves, path, f"KV capacity on {device.name} ({options.kv_dtype} KV)")
    print(f"wrote {path}", file=sys.stderr)


def _does_not_fit(plan: Plan, facts: ModelFacts, options: PlanOptions, device: Device | None) -> str:
    """Why, and which weight formats would fit."""
    if device is None or plan.usable_kv_bytes is None:
        return f"the KV budget {format_bytes(plan.usable_kv_bytes or 0)} holds no {options.block_size}-token block"
    need = plan.weight_bytes + (plan.reserve_bytes or 0)
    why = (
        f"{plan.model} does not fit on {device.name}: weights {format_bytes(plan.weight_bytes)} + reserve {format_bytes(plan.reserve_bytes or 0)}"
        f" = {format_bytes(need)} leave {format_bytes(max(0, plan.usable_kv_bytes))} of {format_bytes(device.memory_bytes)} for the KV cache"
    )
    fitting = []
    for name in WEIGHT_FORMATS:
        other = make_plan(facts, replace(options, weights=parse_weight_format(name)), device)
        if other.fits:
            fitting.append(f"{name} ({format_bytes(other.weight_bytes)})")
    return why + (
        f". Fits with --weights {', '.join(fitting)}" if fitting else ". No weight format fits: choose a bigger device"
    )


if __name__ == "__main__":
    sys.exit(main())
