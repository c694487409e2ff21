"""`kvpager generate`: one prompt (argument, file or stdin) → streamed text on stdout."""

from __future__ import annotations

import argparse
import logging
import sys

from kvpager.engine.args import add_engine_args, config_from_args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpager generate", description=__doc__)
    p.add_argument("prompt", nargs="?", help="prompt text; '-' or omitted with --prompt-file unset reads stdin")
    p.add_argument("--prompt-file", help="read the prompt from this file")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    p.add_argument("--verbose", action="store_true", help="log engine start-up")
    add_engine_args(p)
    return p


def read_prompt(args: argparse.Namespace) -> str:
    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as f:
            return f.read()
    if args.prompt is None or args.prompt == "-":
        return sys.stdin.read()
    return str(args.prompt)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        return _run(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"kvpager generate: error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from kvpager.core.sampling_params import SamplingParams
    from kvpager.engine.engine import Engine

    prompt = read_prompt(args)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        stop=args.stop,
        seed=args.sample_seed,
        ignore_eos=args.ignore_eos,
    )
    engine = Engine(config_from_args(args))
    request: str | list[int] = prompt
    if args.chat:
        text = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        request = engine.tokenizer.encode(text, add_special_tokens=False)
    engine.add_request("generate", request, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.outputs[0].delta_text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0
