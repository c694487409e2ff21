"""Shared benchmark plumbing: machine line, exact command, Markdown tables, JSON output, peak RSS,
and the model/engine set-up every engine-driven bench uses.

Every bench prints (or emits as JSON with `--json`) a dict with at least `bench`, `command` and
`machine`; `--json-out PATH` also writes the same JSON to a file (for benchmarks/).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpager.core.config import FP32_MATMUL_PRECISIONS, LOAD_FORMATS
from kvpager.core.cpuinfo import PROC_CPUINFO, read_cpuinfo

DEFAULT_NUM_THREADS = 2


@dataclass(frozen=True)
class ModelChoice:
    """The checkpoint a bench runs on: a directory and how to load it."""

    model_dir: str
    load_format: str
    is_default_dummy: bool


def add_precision_arg(parser: argparse.ArgumentParser) -> None:
    """--fp32-matmul-precision, as `kvpager serve`'s (kvpager.model.precision)."""
    parser.add_argument(
        "--fp32-matmul-precision",
        choices=FP32_MATMUL_PRECISIONS,
        default="highest",
        help="float32 matmul precision while the model runs (medium: bfloat16 inputs, float32 accumulation)",
    )


def add_common_args(parser: argparse.ArgumentParser, *, with_model: bool = True) -> None:
    """Options shared by every bench: --json, --json-out, --num-threads (and --model/--load-format)."""
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    parser.add_argument("--json-out", default=None, help="also write the JSON result to this file")
    parser.add_argument(
        "--num-threads",
        type=int,
        default=DEFAULT_NUM_THREADS,
        help=f"torch intra-op threads for the engine (default {DEFAULT_NUM_THREADS})",
    )
    if with_model:
        parser.add_argument(
            "--model",
            default=None,
            help="checkpoint directory (default: dummy weights shaped like SmolLM2-135M)",
        )
        parser.add_argument(
            "--load-format",
            default=None,
            choices=LOAD_FORMATS,
            help="default: dummy for the built-in shape, auto for --model",
        )
        parser.add_argument(
            "--dummy-shape",
            default="smollm2-135m",
            help="the built-in shape without --model: smollm2-135m (default), llama-3.2-1b, llama-3.2-3b, "
            "llama-3.1-8b, qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-7b (random weights, published configs)",
        )


def choose_model(args: argparse.Namespace, workdir: str | None = None) -> ModelChoice:
    """`--model` as given, or a fresh dummy SmolLM2-135M-shaped directory (config + tokenizer only)."""
    if args.model is not None:
        return ModelChoice(str(args.model), args.load_format or "auto", False)
    from kvpager.bench.dummy_models import make_dummy_model_dir

    root = workdir or tempfile.mkdtemp(prefix="kvpager-bench-")
    shape = getattr(args, "dummy_shape", "smollm2-135m")
    path = make_dummy_model_dir(Path(root) / f"{shape}-dummy", shape)
    return ModelChoice(str(path), args.load_format or "dummy", shape == "smollm2-135m")


def set_threads(num_threads: int) -> None:
    """Pin torch's intra-op thread count (the engine and the roofline measure with the same count)."""
    if num_threads < 1:
        raise ValueError(f"--num-threads must be >= 1, got {num_threads}")
    import torch

    torch.set_num_threads(num_threads)


def machine_info() -> dict[str, Any]:
    """CPU model, core count, torch version and threads: the machine line of every result."""
    import torch

    return {
        "cpu": cpu_model(),
        **read_cpu_id(PROC_CPUINFO),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def machine_line(info: dict[str, Any]) -> str:
    cuda = f", CUDA {info['cuda']}" if info.get("cuda") else ""
    ident = [f"family/model {info['cpu_family_model']}"] if info.get("cpu_family_model") else []
    if "cpu_flags" in info:
        ident.append(" ".join(info["cpu_flags"]) or "none of " + " ".join(KERNEL_FLAGS))
    cpu = f"{info['cpu']} ({'; '.join(ident)})" if ident else info["cpu"]
    return (
        f"{cpu}, {info['cores']} cores, torch {info['torch']}, {info['threads']} threads, Python {info['python']}{cuda}"
    )


def cpu_model() -> str:
    return read_cpuinfo().get("model name") or platform.processor() or "unknown CPU"


# The instruction-set flags the kernels choose their paths by (a record names which of them the CPU had).
KERNEL_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_bf16")


def read_cpu_id(cpuinfo: Path) -> dict[str, Any]:
    """From a /proc/cpuinfo: the CPU's family / model numbers (one model name spans several generations,
    AMD EPYC among them) and which of KERNEL_FLAGS it has; empty where the file does not say."""
    fields = read_cpuinfo(cpuinfo)
    out: dict[str, Any] = {}
    if "cpu family" in fields and "model" in fields:
        out["cpu_family_model"] = f"{fields['cpu family']}/{fields['model']}"
    if "flags" in fields:
        have = set(fields["flags"].split())
        out["cpu_flags"] = [f for f in KERNEL_FLAGS if f in have]
    return out


def command_line(sub: str, argv: Sequence[str]) -> str:
    """The exact command that reproduces this run."""
    return shlex.join(["kvpager", "bench", sub, *argv])


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (ru_maxrss is KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]; ValueError on an empty list."""
    if not values:
        raise ValueError("percentile of an empty list")
    data = sorted(values)
    pos = (len(data) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (pos - low)


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-flavoured Markdown table; floats get 3 significant decimals."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)


def emit(result: dict[str, Any], markdown: str, args: argparse.Namespace) -> None:
    """Print the result (Markdown, or JSON with --json) and write --json-out if asked."""
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result))
        return
    print(f"machine: {machine_line(result['machine'])}")
    print(f"command: {result['command']}")
    print(markdown)


def log(args: argparse.Namespace, message: str) -> None:
    """Progress on stderr, so --json stdout stays one parseable object."""
    print(message, file=sys.stderr, flush=True)
