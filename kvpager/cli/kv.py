"""`kvpager kv save | inspect | top`: write a KV pack from a prompt once; print a pack's header; watch a server's KV.

    kvpager kv save --model M --prompt-file F [--chat] [--codec C] -o X.kvpack
    kvpager kv inspect X.kvpack [--json]
    kvpager kv top --url http://127.0.0.1:8000 [--once]    (see kv_top.py)

A pack is loaded at start with `kvpager serve --kv-pack X.kvpack` (repeatable): its blocks are
pinned in the prefix cache, so a request starting with the same tokens pays no prefill for them.
With `--chat` the text is the system message of the model's chat template (no generation prompt),
the prefix a chat request with that system prompt starts with.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from kvpager.cli.kv_top import add_top_parser, main_top
from kvpager.core.config import KV_CODECS
from kvpager.engine.args import add_engine_args, config_from_args

MAX_SHOWN_TOKEN_IDS = 16


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvpager kv", description="KV packs: save a prefilled prompt, inspect a pack; watch a server's KV map"
    )
    sub = p.add_subparsers(dest="command", required=True)
    save = sub.add_parser("save", help="prefill a text once and write its KV pack")
    save.add_argument("--prompt-file", required=True, help="UTF-8 text to prefill")
    save.add_argument("--chat", action="store_true", help="use the text as the chat template's system message")
    save.add_argument("--codec", default="lossless", choices=list(KV_CODECS), help="block codec (default lossless)")
    save.add_argument("-o", "--output", required=True, help="pack file to write, e.g. system.kvpack")
    save.add_argument("--verbose", action="store_true", help="log engine start-up")
    add_engine_args(save)
    inspect = sub.add_parser("inspect", help="print a pack's header and size")
    inspect.add_argument("pack", help="a .kvpack file")
    inspect.add_argument("--json", action="store_true", help="print the full header as JSON")
    add_top_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING, format="%(message)s"
    )
    try:
        commands = {"save": _save, "inspect": _inspect, "top": main_top}
        return commands[args.command](args)
    except (ValueError, OSError) as error:
        print(f"kvpager kv {args.command}: error: {error}", file=sys.stderr)
        return 2


def prompt_token_ids(tokenizer: Any, text: str, chat: bool) -> list[int]:
    """The token ids a request for `text` starts with (chat: the system message, no generation prompt)."""
    if not chat:
        return list(tokenizer.encode(text))
    rendered = tokenizer.apply_chat_template([{"role": "system", "content": text}], add_generation_prompt=False)
    return list(tokenizer.encode(rendered, add_special_tokens=False))


def _save(args: argparse.Namespace) -> int:
    from kvpager.engine.engine import Engine
    from kvpager.kvstore.pack import inspect_pack

    text = Path(args.prompt_file).read_text(encoding="utf-8")
    if not text:
        raise ValueError(f"prompt file {args.prompt_file} is empty")
    engine = Engine(config_from_args(args))
    token_ids = prompt_token_ids(engine.tokenizer, text, args.chat)
    start = time.perf_counter()
    data = engine.export_kv(token_ids, args.codec)
    seconds = time.perf_counter() - start
    _write_atomic(Path(args.output), data)
    info = inspect_pack(args.output)
    num_tokens = info["num_blocks"] * engine.config.block_size
    tail = len(token_ids) - num_tokens
    print(
        f"wrote {args.output}: {len(data)} bytes, {info['num_blocks']} blocks holding {num_tokens} of "
        f"{len(token_ids)} tokens"
        + (f" (the last {tail} fill no whole block)" if tail else "")
        + f", codec {args.codec}, prefill+encode {seconds:.2f} s"
    )
    return 0


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name("." + path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def _inspect(args: argparse.Namespace) -> int:
    from kvpager.kvstore.pack import inspect_pack

    info = inspect_pack(args.pack)
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=True))
        return 0
    for line in describe(info):
        print(line)
    return 0


def describe(info: dict[str, Any]) -> list[str]:
    """Human-readable header lines (token ids and block list shortened)."""
    token_ids = info["token_ids"]
    shown = ", ".join(str(t) for t in token_ids[:MAX_SHOWN_TOKEN_IDS])
    more = f", … {len(token_ids) - MAX_SHOWN_TOKEN_IDS} more" if len(token_ids) > MAX_SHOWN_TOKEN_IDS else ""
    model = info["model"]
    rows = [
        ("file size", f"{info['file_size']} bytes ({info['payload_bytes']} of block payloads)"),
        ("format", f"{info['format']} v{info['format_version']} (written by kvpager {info['kvpager_version']})"),
        ("created at", time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["created_at"]))),
        ("model fingerprint", info["model_fingerprint"]),
        *((f"model.{key}", value) for key, value in sorted(model.items())),
        ("codec", info["codec"]),
        ("block shape", info["block_shape"]),
        ("blocks", f"{info['num_blocks']} ({info['num_blocks'] * model['block_size']} tokens)"),
        ("token ids", f"{len(token_ids)} [{shown}{more}]"),
    ]
    if info["blocks"]:
        rows.append(("first block hash", info["blocks"][0]["hash"]))
    return [f"{name + ':':<24}{value}" for name, value in rows]


if __name__ == "__main__":
    sys.exit(main())
