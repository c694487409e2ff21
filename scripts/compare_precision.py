"""How far `--fp32-matmul-precision medium` and `--kv-cache-dtype bfloat16` move a model's outputs
from the exact ones.

Two measurements on one checkpoint (default: the bundled demo model), for each configuration
(matmul precision highest or medium, KV cache float32 or bfloat16):
1. logits: every position of a batch of prompts (one forward of > 32 rows, so the linear layers take
   the bf16 path at medium) against transformers in float32;
2. greedy generation: `--num-prompts` prompts generated together (decode batches > 32 rows); how
   many sequences come out identical to the exact configuration's, and where the others first diverge.

Usage: python scripts/compare_precision.py [--model DIR] [--num-prompts 64] [--max-tokens 64]
(prints a Markdown table)
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvpager.api.llm import LLM  # noqa: E402
from kvpager.core.sampling_params import SamplingParams  # noqa: E402
from kvpager.engine.paths import demo_model_dir  # noqa: E402
from kvpager.model.attention import allocate_kv_cache, build_attention_metadata  # noqa: E402
from kvpager.model.loader import load_model  # noqa: E402
from kvpager.model.precision import fp32_matmul_precision  # noqa: E402

CONFIGS = (("highest", "float32"), ("medium", "float32"), ("highest", "bfloat16"), ("medium", "bfloat16"))


def logit_errors(model_dir: str, prompts: list[list[int]]) -> dict[tuple[str, str], tuple[float, float]]:
    """(precision, KV dtype) -> (max |logit diff| vs transformers float32, argmax agreement)."""
    from transformers import AutoModelForCausalLM

    model = load_model(model_dir, dtype=torch.float32, device="cpu")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    block = 16
    tables, nxt = [], 0
    for p in prompts:
        n = -(-len(p) // block)
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
    lens = [len(p) for p in prompts]
    ids = torch.tensor([t for p in prompts for t in p])
    pos = torch.tensor([i for p in prompts for i in range(len(p))])
    out = {}
    with torch.inference_mode():
        ref = torch.cat([hf(torch.tensor([p])).logits[0] for p in prompts])
        for precision, kv_dtype in CONFIGS:
            kv = allocate_kv_cache(model.spec, nxt, block, getattr(torch, kv_dtype), "cpu")
            meta = build_attention_metadata(lens, lens, tables, block, "cpu")
            with fp32_matmul_precision(precision):
                logits = model.compute_logits(model(ids, pos, kv, meta))
            agreement = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
            out[precision, kv_dtype] = ((logits - ref).abs().max().item(), agreement)
    return out


def greedy(model_dir: str, prompts: list[list[int]], max_tokens: int, precision: str, kv_dtype: str) -> list[list[int]]:
    llm = LLM(
        model_dir,
        fp32_matmul_precision=precision,
        kv_cache_dtype=kv_dtype,
        kv_cache_memory=256 << 20,
        max_num_seqs=len(prompts),
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def divergence(exact: list[list[int]], other: list[list[int]]) -> str:
    diverge = [
        next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), None)
        for x, y in zip(exact, other, strict=True)
    ]
    firsts = [d for d in diverge if d is not None]
    same = f"{len(diverge) - len(firsts)} of {len(diverge)} identical"
    return (
        f"{same}; others first differ at token {statistics.median(firsts):.0f} (median), {min(firsts)} (min)"
        if firsts
        else same
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(demo_model_dir()))
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(2)
    from kvpager.model.spec import load_model_spec

    vocab = load_model_spec(args.model).vocab_size
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(1, vocab) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]
    errs = logit_errors(args.model, prompts[:4])
    exact = greedy(args.model, prompts, args.max_tokens, "highest", "float32")
    print(
        f"| matmul precision | KV cache | max abs logit diff vs transformers fp32 ({min(4, len(prompts))} x "
        f"{args.prompt_len} positions) | argmax agreement | greedy, {args.num_prompts} prompts x {args.max_tokens} "
        "tokens in one batch, vs highest/float32 |"
    )
    print("|---|---|---|---|---|")
    for precision, kv_dtype in CONFIGS:
        diff, agreement = errs[precision, kv_dtype]
        tokens = (
            exact
            if (precision, kv_dtype) == CONFIGS[0]
            else greedy(args.model, prompts, args.max_tokens, precision, kv_dtype)
        )
        same = "—" if tokens is exact else divergence(exact, tokens)
        print(f"| {precision} | {kv_dtype} | {diff:.2e} | {agreement:.1%} | {same} |")


if __name__ == "__main__":
    main()
