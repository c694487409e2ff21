"""Accuracy of each weight format against float32: perplexity and top-1 agreement on held-out KJV text.

The text (scripts/data/kjv_heldout.txt) is the first six chapters that scripts/train_demo_model.py
holds out of training (every 40th chapter of the KJV, public domain, from Debian's bible-kjv), so the
bundled demo model never saw it. Each chapter is one document, scored teacher-forced through kvpager's
own model (paged KV cache, prefill in chunks): perplexity = exp(mean next-token NLL); top-1
agreement = share of positions where the format's argmax equals float32's. The quantized formats
run with the lm_head int8 per output channel (kvpager's default, --quantize-lm-head);
--no-quantize-lm-head scores them with the lm_head in the format's dtype instead. Every position is
a prompt row (chunks of 128), so on CPUs with native bf16 matmul the int8-activation formats run
their prompt path there, the bf16 GEMM (docs/precision.md); --prompt-path integer-dot scores them
with the int8 activations instead, as decode rows and CPUs without bf16 matmul compute.

    python scripts/quant_accuracy.py                      # the demo model, every format
    python scripts/quant_accuracy.py --model DIR --formats float32,int4-g32 --json
    python scripts/quant_accuracy.py --no-quantize-lm-head          # the lm_head left in the dtype
    python scripts/quant_accuracy.py --prompt-path integer-dot      # w8a8 / w4a8 prompts without bf16 GEMM
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvpager.model import allocate_kv_cache, build_attention_metadata, load_model  # noqa: E402
from kvpager.text.tokenizer import Tokenizer  # noqa: E402

TEXT = Path(__file__).parent / "data" / "kjv_heldout.txt"
SEPARATOR = "<|endoftext|>\n"
CHUNK = 128  # prefill chunk (tokens per forward)
BLOCK = 16
# name -> (dtype, quantization, group size)
FORMATS: dict[str, tuple[torch.dtype, str | None, int | None]] = {
    "float32": (torch.float32, None, None),
    "bfloat16": (torch.bfloat16, None, None),
    "int8": (torch.float32, "int8", None),
    "int8-g32": (torch.float32, "int8", 32),
    "int4-g128": (torch.float32, "int4", 128),
    "int4-g64": (torch.float32, "int4", 64),
    "int4-g32": (torch.float32, "int4", 32),
    "bf16+int4-g32": (torch.bfloat16, "int4", 32),
    # the same weights, activations quantized to int8 per block of 32 at each matmul (not exact)
    "w8a8_int8": (torch.float32, "w8a8_int8", None),
    "w8a8_int8-g32": (torch.float32, "w8a8_int8", 32),
    "w4a8_int8-g128": (torch.float32, "w4a8_int8", 128),
    "w4a8_int8-g32": (torch.float32, "w4a8_int8", 32),
}


@dataclass(frozen=True)
class Score:
    format: str
    weight_bytes: int
    tokens: int
    perplexity: float
    top1_agreement: float  # vs float32's argmax


def document_logits(model: torch.nn.Module, ids: list[int], dtype: torch.dtype) -> torch.Tensor:
    """float32 logits at every position of one document, prefilled CHUNK tokens at a time."""
    spec = model.spec  # type: ignore[attr-defined]
    blocks = -(-len(ids) // BLOCK)
    kv = allocate_kv_cache(spec, blocks, BLOCK, dtype, "cpu")
    table = list(range(blocks))
    out = []
    with torch.inference_mode():
        for start in range(0, len(ids), CHUNK):
            chunk = ids[start : start + CHUNK]
            meta = build_attention_metadata([len(chunk)], [start + len(chunk)], [table], BLOCK, "cpu")
            positions = torch.arange(start, start + len(chunk))
            hidden = model(torch.tensor(chunk), positions, kv, meta)
            out.append(model.compute_logits(hidden).float())  # type: ignore[operator]
    return torch.cat(out)


def score(
    model_dir: Path,
    name: str,
    docs: list[list[int]],
    reference: list[torch.Tensor] | None,
    quantize_lm_head: bool = True,
) -> tuple[Score, list[torch.Tensor]]:
    from kvpager.model.loader import model_weight_bytes

    dtype, quantization, group = FORMATS[name]
    model = load_model(
        model_dir,
        dtype=dtype,
        device="cpu",
        quantization=quantization,
        quantization_group_size=group,
        quantize_lm_head=quantize_lm_head,
    )
    nll, agree, count, all_logits = 0.0, 0, 0, []
    for i, ids in enumerate(docs):
        logits = document_logits(model, ids, dtype)[:-1]
        targets = torch.tensor(ids[1:])
        nll += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
        ref = reference[i] if reference is not None else logits
        agree += int((logits.argmax(-1) == ref.argmax(-1)).sum())
        count += len(targets)
        all_logits.append(logits)
    result = Score(name, model_weight_bytes(model), count, math.exp(nll / count), agree / count)
    return result, all_logits


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=ROOT / "kvpager" / "demo_model")
    p.add_argument("--text", type=Path, default=TEXT, help="documents separated by <|endoftext|> lines")
    p.add_argument("--formats", default=",".join(FORMATS), help=f"comma list of {', '.join(FORMATS)}")
    p.add_argument("--max-tokens", type=int, default=1023, help="tokens per document at most (then cut)")
    p.add_argument(
        "--quantize-lm-head",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="quantized formats: the lm_head int8 per output channel (default, as kvpager serve) or in the dtype",
    )
    p.add_argument(
        "--prompt-path",
        choices=("auto", "integer-dot"),
        default="auto",
        help="int8-activation formats: the prompt path this CPU takes (auto: the bf16 GEMM past 64 rows "
        "where oneDNN has native bf16 matmul) or the integer dot at every chunk, as on CPUs without it",
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.prompt_path == "integer-dot":
        from kvpager.model.backends import quant_dot

        quant_dot.native_bf16.cache_clear()
        quant_dot.native_bf16 = lambda: False  # type: ignore[assignment]
    names = [n.strip() for n in args.formats.split(",") if n.strip()]
    unknown = [n for n in names if n not in FORMATS]
    if unknown:
        p.error(f"unknown format(s) {unknown}; choose from {', '.join(FORMATS)}")
    torch.manual_seed(0)
    tokenizer = Tokenizer.from_dir(args.model)
    from kvpager.model import load_model_spec

    limit = min(args.max_tokens, load_model_spec(args.model).max_position_embeddings - 1)
    eot = tokenizer.token_to_id("<|endoftext|>")
    docs = []
    for text in args.text.read_text(encoding="utf-8").split(SEPARATOR):
        ids = tokenizer.encode(text, add_special_tokens=False)
        docs.append(([eot] if eot is not None else []) + ids[:limit])
    reference_score, reference = score(args.model, "float32", docs, None)
    others = [n for n in names if n != "float32"]
    rows = [reference_score] + [score(args.model, n, docs, reference, args.quantize_lm_head)[0] for n in others]
    if args.json:
        print(json.dumps([r.__dict__ for r in rows], indent=2))
        return 0
    head = "int8 per output channel" if args.quantize_lm_head else "in the dtype"
    print(f"model {args.model.name}, {len(docs)} held-out documents, {rows[0].tokens} scored tokens")
    print(f"quantized formats: lm_head {head}\n")
    print("| format | weight MiB | perplexity | vs float32 | top-1 agreement with float32 |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        rel = r.perplexity / reference_score.perplexity - 1
        print(
            f"| {r.format} | {r.weight_bytes / 2**20:.2f} | {r.perplexity:.3f} | {rel:+.2%} | {r.top1_agreement:.2%} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
