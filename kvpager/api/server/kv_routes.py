"""KV transfer over HTTP: `POST /v1/kv/export` and `POST /v1/kv/import` (behind the API key when set).

Export: a prompt (text, token ids, or chat messages rendered without a generation prompt) → the KV
pack bytes of its full blocks (`application/octet-stream`; format: docs/kv-pack-format.md), with
`X-KVPager-Num-Blocks` (full blocks in the payload) and `X-KVPager-Num-Tokens` (the tokens they
cover). Blocks not cached yet are prefilled first, on the engine thread, between steps.
Import: such bytes → the local prefix cache; `{"num_blocks_imported": N}`. Off unless the server
runs with `--enable-kv-import` (403, body unread, otherwise), which needs `--kv-transfer-key`: the
route accepts that key (or the API key) as its bearer token, and every payload must carry the
`X-KVPager-KV-Signature` its exporter made with the same key (401 otherwise: an unsigned or forged
payload never reaches the cache). With the key set, every export is signed. The body is bounded by
`--max-kv-import-bytes` (413 above it), and a payload made for another model, dtype, block size or
tokenizer, a corrupted one, one with NaN/Inf values or more tokens than max_model_len is refused
with 400 naming the problem; nothing is imported then. Threat model: docs/security.md.
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from kvpager.api.server.errors import ApiError
from kvpager.api.server.protocol import KVExportRequest, KVImportResponse
from kvpager.api.server.serving import Serving, engine_error
from kvpager.core.config import KV_CODECS
from kvpager.engine.async_engine import AsyncEngine
from kvpager.kvstore.signing import SIGNATURE_HEADER, sign_payload, verify_payload

EXPORT_PATH = "/v1/kv/export"
IMPORT_PATH = "/v1/kv/import"
DEFAULT_MAX_KV_IMPORT_BYTES = 1 << 30
IMPORT_DISABLED = (
    "KV import is disabled on this server; start it with --enable-kv-import and --kv-transfer-key "
    "(see docs/security.md)"
)


def add_kv_routes(
    app: FastAPI,
    serving: Serving,
    engine: AsyncEngine,
    chat_template: str | None,
    max_import_bytes: int,
    transfer_key: str | None = None,
) -> None:
    """Register the export and import routes on `app`."""

    @app.post(EXPORT_PATH)
    async def export_kv(req: KVExportRequest) -> Response:
        serving.check_model(req.model)
        token_ids = export_token_ids(serving, req, chat_template)
        if req.codec not in KV_CODECS:
            raise ApiError(400, f"codec must be one of {', '.join(KV_CODECS)}; got {req.codec!r}", param="codec")
        block_size = int(engine.config.block_size)
        num_blocks = len(token_ids) // block_size
        if num_blocks == 0:
            raise ApiError(
                400,
                f"the prompt has {len(token_ids)} tokens, fewer than one KV block of {block_size}; nothing to export",
                param="prompt",
            )
        codec = req.codec
        try:
            payload = await engine.run_in_engine(lambda e: e.export_kv(token_ids, codec))
        except Exception as exc:
            raise engine_error(exc) from exc
        headers = {"X-KVPager-Num-Blocks": str(num_blocks), "X-KVPager-Num-Tokens": str(num_blocks * block_size)}
        if transfer_key:
            headers[SIGNATURE_HEADER] = await asyncio.to_thread(sign_payload, transfer_key, payload)
        return Response(payload, media_type="application/octet-stream", headers=headers)

    @app.post(IMPORT_PATH)
    async def import_kv(request: Request) -> JSONResponse:
        payload = await request.body()
        if not payload:
            raise ApiError(400, "the request body is empty; send the bytes of a KV payload from /v1/kv/export")
        if not transfer_key:  # NOTE: the key middleware already answers 403 then; this keeps the route safe alone
            raise ApiError(403, IMPORT_DISABLED, code="disabled")
        try:
            await asyncio.to_thread(verify_payload, transfer_key, payload, request.headers.get(SIGNATURE_HEADER))
        except ValueError as exc:
            raise ApiError(401, str(exc), code="invalid_kv_signature") from exc
        try:
            num_blocks = await engine.import_kv(payload, max_import_bytes)
        except ValueError as exc:
            status = 413 if "over the limit" in str(exc) else 400
            raise ApiError(status, str(exc), code="invalid_kv_payload") from exc
        except Exception as exc:
            raise engine_error(exc) from exc
        return JSONResponse(KVImportResponse(num_blocks_imported=int(num_blocks)).model_dump())


def export_token_ids(serving: Serving, req: KVExportRequest, chat_template: str | None) -> list[int]:
    """The token ids to export: exactly one of prompt, prompt_token_ids or messages (400 otherwise)."""
    given = [name for name in ("prompt", "prompt_token_ids", "messages") if getattr(req, name) is not None]
    if len(given) != 1:
        raise ApiError(400, f"send exactly one of `prompt`, `prompt_token_ids` or `messages` (got {given})")
    if req.messages is not None:
        return serving.chat_prompt(req.messages, False, chat_template).token_ids
    if req.prompt_token_ids is not None:
        if not req.prompt_token_ids:
            raise ApiError(400, "prompt_token_ids must not be empty", param="prompt_token_ids")
        return serving.completion_prompts(req.prompt_token_ids)[0].token_ids
    if not req.prompt:
        raise ApiError(400, "prompt must not be empty", param="prompt")
    return serving.completion_prompts(req.prompt)[0].token_ids
