"""`kvpager serve`: the OpenAI-compatible HTTP server (uvicorn), with vLLM's flag spellings."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kvpager.api.server.app import DEFAULT_MAX_REQUEST_BODY_BYTES, ServerSettings
from kvpager.api.server.disagg import DEFAULT_PREFILL_TIMEOUT_S, ROLES, PrefillSettings
from kvpager.api.server.kv_routes import DEFAULT_MAX_KV_IMPORT_BYTES
from kvpager.api.server.tools import TOOL_PARSERS
from kvpager.engine.args import add_engine_args, bytes_arg, config_from_args

if TYPE_CHECKING:
    from fastapi import FastAPI

    from kvpager.engine.async_engine import AsyncEngine

logger = logging.getLogger("kvpager.api.server")

API_KEY_ENV = "KVPAGER_API_KEY"
PREFILL_API_KEY_ENV = "KVPAGER_PREFILL_API_KEY"
KV_TRANSFER_KEY_ENV = "KVPAGER_KV_TRANSFER_KEY"
# Requests waiting for a slot before new ones get 503 + Retry-After (each holds its prompt in memory).
DEFAULT_MAX_WAITING_REQUESTS = 1024


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvpager serve", description="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, ...)."
    )
    p.add_argument("model_tag", nargs="?", default=None, help="checkpoint directory (same as --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--served-model-name", nargs="+", default=None, help="name(s) clients use in `model` (default: --model)"
    )
    p.add_argument("--api-key", default=None, help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV})")
    p.add_argument("--chat-template", default=None, help="Jinja2 chat template file (default: the tokenizer's)")
    p.add_argument(
        "--max-request-body-bytes",
        type=bytes_arg,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="413 above this, e.g. 16MiB",
    )
    p.add_argument(
        "--max-waiting-requests",
        type=int,
        default=DEFAULT_MAX_WAITING_REQUESTS,
        help=f"503 + Retry-After when this many requests wait (default: {DEFAULT_MAX_WAITING_REQUESTS})",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="N engine replicas on Ray Serve behind this endpoint, routed by prefix-cache state "
        "(needs pip install 'kvpager[ray]'; joins $RAY_ADDRESS when set)",
    )
    p.add_argument(
        "--prefill-replicas",
        type=int,
        default=None,
        help="with --replicas N: also deploy M prefill replicas in the same Ray Serve application; the N "
        "replicas decode, fetching each prompt's KV from the prefill replica holding its prefix "
        "(needs --kv-transfer-key)",
    )
    p.add_argument(
        "--cpus-per-replica",
        type=float,
        default=1.0,
        help="with --replicas: Ray CPUs each engine replica reserves (default 1; e.g. 0.5 to place 2 decode + "
        "2 prefill replicas on a 2-core machine)",
    )
    p.add_argument(
        "--replica-router",
        default="kv-aware",
        choices=["kv-aware", "kv-aware-store", "power-of-two"],
        help="with --replicas: kv-aware (device prefix-cache state + queue length), kv-aware-store (the "
        "device match beyond what the shared store holds, then queue length) or Ray Serve's default",
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        choices=list(TOOL_PARSERS),
        help="parse the model's own tool calls for tool_choice \"auto\" (vLLM's names)",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='accepted for vLLM compatibility: "auto" is enabled by --tool-call-parser',
    )
    p.add_argument(
        "--headless",
        action="store_true",
        help="run only this node's tensor-parallel worker ranks (no engine, no API server): a node R > 0 of "
        "--nnodes, with --node-rank R and node 0's --master-addr/--master-port",
    )
    add_kv_transfer_args(p)
    add_engine_args(p)
    return p


def add_kv_transfer_args(p: argparse.ArgumentParser) -> None:
    """KV over HTTP: the import size bound and the disaggregated prefill/decode roles."""
    g = p.add_argument_group("KV transfer and disaggregated serving")
    g.add_argument(
        "--max-kv-import-bytes",
        type=bytes_arg,
        default=DEFAULT_MAX_KV_IMPORT_BYTES,
        help="413 above this on /v1/kv/import (default 1GiB)",
    )
    g.add_argument(
        "--enable-kv-import",
        action="store_true",
        help="accept POST /v1/kv/import (off by default; needs --kv-transfer-key; see docs/security.md)",
    )
    g.add_argument(
        "--kv-transfer-key",
        default=None,
        help=f"HMAC key shared by a prefill/decode pair: exports are signed, imports verified (default: ${KV_TRANSFER_KEY_ENV})",
    )
    g.add_argument(
        "--role",
        default="both",
        choices=list(ROLES),
        help="decode: fetch each prompt's KV from --prefill-url, then decode here (default: both)",
    )
    g.add_argument("--prefill-url", default=None, help="prefill server root, e.g. http://10.0.0.2:8000")
    g.add_argument(
        "--prefill-api-key", default=None, help=f"the prefill server's API key (default: ${PREFILL_API_KEY_ENV})"
    )
    g.add_argument(
        "--prefill-timeout",
        type=float,
        default=DEFAULT_PREFILL_TIMEOUT_S,
        help="seconds to wait for the prefill server before prefilling locally",
    )


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    """The HTTP settings; the chat template file is read here so a bad path fails at start."""
    template = None
    if args.chat_template is not None:
        path = Path(args.chat_template).expanduser()
        if not path.is_file():
            raise ValueError(f"--chat-template {args.chat_template!r} is not a file; pass a Jinja2 template file")
        template = path.read_text(encoding="utf-8")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME")
    prefill = None
    if args.prefill_url is not None:
        prefill = PrefillSettings(
            url=args.prefill_url,
            api_key=args.prefill_api_key or os.environ.get(PREFILL_API_KEY_ENV) or None,
            timeout_s=args.prefill_timeout,
        )
    return ServerSettings(
        served_model_names=list(args.served_model_name or []),
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        max_request_body_bytes=args.max_request_body_bytes,
        chat_template=template,
        max_kv_import_bytes=args.max_kv_import_bytes,
        role=args.role,
        prefill=prefill,
        tool_call_parser=args.tool_call_parser,
        enable_kv_import=args.enable_kv_import,
        kv_transfer_key=args.kv_transfer_key or os.environ.get(KV_TRANSFER_KEY_ENV) or None,
    )


def main(argv: list[str] | None = None) -> int:
    """Run the server until interrupted. Returns the process exit code."""
    args = build_parser().parse_args(argv)
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            print("kvpager serve: error: give the model once (positional or --model)", file=sys.stderr)
            return 2
        args.model = args.model_tag
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = settings_from_args(args)
        config = config_from_args(args)
        if args.headless:
            from kvpager.engine.tp_node import run_headless

            return run_headless(config)
        if config.node_rank != 0:
            raise ValueError(f"--node-rank {config.node_rank} runs worker ranks only: add --headless")
        if args.max_waiting_requests is not None and args.max_waiting_requests < 0:
            raise ValueError(f"--max-waiting-requests must be >= 0, got {args.max_waiting_requests}")
        if args.prefill_replicas is not None and args.replicas is None:
            raise ValueError("--prefill-replicas M needs --replicas N (the decode replicas next to the prefill pool)")
        if args.replicas is not None:
            from kvpager.api.replicas.launch import serve_replicas

            return serve_replicas(
                config,
                settings,
                args.replicas,
                args.host,
                args.port,
                max_waiting=args.max_waiting_requests,
                router=args.replica_router,
                cpus_per_replica=args.cpus_per_replica,
                prefill_replicas=args.prefill_replicas or 0,
                prefill_timeout_s=args.prefill_timeout,
            )
        return _serve(args, config, settings)
    except (ValueError, FileNotFoundError) as exc:
        print(f"kvpager serve: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # NOTE: only the tensor-parallel rendezvous's; anything else is a bug to show
        from kvpager.engine.executor import RendezvousError

        if not isinstance(exc, RendezvousError):
            raise
        print(f"kvpager serve: error: {exc}", file=sys.stderr)
        return 1


def build_server(args: argparse.Namespace, config: object, settings: ServerSettings) -> tuple[AsyncEngine, FastAPI]:
    """The engine, its loop thread (started) and the ASGI app, as `kvpager serve` runs them.

    Everything built so far (model, tokenizer, the libraries) lives as long as the server, so it is
    moved out of the garbage collector's sight (`gc.freeze`, as vLLM does): a full collection of
    it takes ~0.2 s, holding the GIL, and the engine thread cannot start its next kernel meanwhile.
    """
    from kvpager.api.server.app import build_app
    from kvpager.engine.async_engine import AsyncEngine
    from kvpager.engine.engine import Engine

    engine = Engine(config)  # type: ignore[arg-type]  # logs the KV pool: blocks, tokens, max concurrency
    async_engine = AsyncEngine(engine, max_waiting=args.max_waiting_requests)
    app = build_app(async_engine, settings)
    gc.collect()
    gc.freeze()
    async_engine.start()
    return async_engine, app


def _serve(args: argparse.Namespace, config: object, settings: ServerSettings) -> int:
    import uvicorn

    async_engine, app = build_server(args, config, settings)
    engine = async_engine.engine
    if settings.role == "prefill" and not settings.kv_transfer_key:
        logger.warning(
            "--role prefill without --kv-transfer-key: exports are unsigned, decode servers will refuse them"
        )
    logger.info(
        "serving %s on http://%s:%d/v1 (role %s%s)",
        settings.served_model_names or [engine.model_name],
        args.host,
        args.port,
        settings.role,
        f", prefill server {settings.prefill.base_url}" if settings.prefill is not None else "",
    )
    logger.info("KV memory, live: http://%s:%d/kv (the same as JSON: /v1/kv/map)", args.host, args.port)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    finally:
        async_engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
