"""The FastAPI app of `kvpager serve`: OpenAI's HTTP API over one AsyncEngine.

`build_app(engine, settings)` wires the routes, the guards (body size, API key) and the error
handlers that keep every error in OpenAI's shape (pydantic's 422 becomes a 400).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from kvpager.api.server.chat import create_chat_completion
from kvpager.api.server.completions import create_completion
from kvpager.api.server.disagg import ROLES, PrefillClient, PrefillSettings
from kvpager.api.server.errors import ApiError, ApiKeyMiddleware, BodyLimit, BodyLimitMiddleware, CookieAuth
from kvpager.api.server.fields import FieldReporter
from kvpager.api.server.kv_routes import DEFAULT_MAX_KV_IMPORT_BYTES, IMPORT_PATH, add_kv_routes
from kvpager.api.server.kv_view import (
    COOKIE_NAME,
    COOKIE_PATHS,
    OPEN_VIEW_PATHS,
    KVMapSampler,
    add_kv_view_routes,
    cookie_token,
)
from kvpager.api.server.metrics import CONTENT_TYPE, ServerMetrics
from kvpager.api.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    error_body,
)
from kvpager.api.server.serving import Serving
from kvpager.api.server.tools import TOOL_PARSERS
from kvpager.engine.async_engine import AsyncEngine, EngineDeadError

logger = logging.getLogger("kvpager.api.server")

DEFAULT_MAX_REQUEST_BODY_BYTES = 16 << 20
# Paths that stay reachable without the API key (as in vLLM, only the API itself is guarded).
OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})
KV_STATS_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ServerSettings:
    """What the HTTP layer needs beyond the engine. `served_model_names[0]` is reported back."""

    served_model_names: list[str] = field(default_factory=list)
    api_key: str | None = None
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    chat_template: str | None = None  # template text (from --chat-template); None: the tokenizer's
    max_kv_import_bytes: int = DEFAULT_MAX_KV_IMPORT_BYTES  # body bound of /v1/kv/import
    role: str = "both"  # both | prefill | decode (decode fetches prompt KV from `prefill`)
    prefill: PrefillSettings | None = None
    tool_call_parser: str | None = None  # parses the model's own tool calls for tool_choice "auto"

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(
                f"--tool-call-parser must be one of {', '.join(TOOL_PARSERS)}; got {self.tool_call_parser!r}"
            )
        if self.max_request_body_bytes < 1:
            raise ValueError(f"max_request_body_bytes must be >= 1, got {self.max_request_body_bytes}")
        if self.max_kv_import_bytes < 1:
            raise ValueError(f"--max-kv-import-bytes must be >= 1, got {self.max_kv_import_bytes}")
        if self.role not in ROLES:
            raise ValueError(f"--role must be one of {', '.join(ROLES)}; got {self.role!r}")
        if (self.role == "decode") != (self.prefill is not None):
            raise ValueError("--role decode needs --prefill-url URL, and --prefill-url is only for --role decode")


def build_app(engine: AsyncEngine, settings: ServerSettings) -> FastAPI:
    """The ASGI app serving `engine`; the engine loop starts with the app (idempotent)."""
    names = list(settings.served_model_names) or [engine.model_name]
    prefill = None
    if settings.prefill is not None:
        prefill = PrefillClient(settings.prefill, int(engine.config.block_size), settings.max_kv_import_bytes)
    metrics = ServerMetrics(engine.stats, names[0], prefill.stats.as_dict if prefill is not None else None)
    serving = Serving(engine, names, metrics, prefill)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            if prefill is not None:
                await prefill.aclose()
            # NOTE: stops the loop and calls engine.shutdown(), which flushes the KV tiers to disk.
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="kvpager", lifespan=lifespan, docs_url=None, redoc_url=None)
    _add_error_handlers(app)
    _add_routes(app, serving, engine, settings)
    add_kv_routes(app, serving, engine, settings.chat_template, settings.max_kv_import_bytes)
    remote = prefill.stats.as_dict if prefill is not None else None
    app.state.kv_sampler = KVMapSampler(engine, remote, model_name=names[0])
    add_kv_view_routes(app, app.state.kv_sampler, settings.api_key)
    # NOTE: added last so they run first: no body is parsed before the size and key checks.
    if settings.api_key:
        cookie = CookieAuth(COOKIE_NAME, cookie_token(settings.api_key), COOKIE_PATHS)
        app.add_middleware(
            ApiKeyMiddleware, api_key=settings.api_key, open_paths=OPEN_PATHS | OPEN_VIEW_PATHS, cookie=cookie
        )
    kv_limit = BodyLimit(settings.max_kv_import_bytes, "--max-kv-import-bytes")
    app.add_middleware(
        BodyLimitMiddleware, max_bytes=settings.max_request_body_bytes, route_limits={IMPORT_PATH: kv_limit}
    )
    return app


def _add_routes(app: FastAPI, serving: Serving, engine: AsyncEngine, settings: ServerSettings) -> None:
    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.is_running else 503)

    @app.get("/version")
    async def version() -> JSONResponse:
        from kvpager import __version__

        return JSONResponse({"version": __version__})

    started = int(time.time())  # `created` of every model card: when this server started

    def card(name: str) -> ModelCard:
        return ModelCard(id=name, created=started, root=engine.model_name, max_model_len=engine.max_model_len)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(ModelList(data=[card(name) for name in serving.served_names]).model_dump())

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        if model_id not in serving.served_names:
            raise ApiError(404, f"The model `{model_id}` does not exist.", code="model_not_found", param="model")
        return JSONResponse(card(model_id).model_dump())

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> JSONResponse:
        """vLLM's tokenizer description, which lm-eval's remote tokenizer backend reads."""
        return JSONResponse(tokenizer_description(serving.tokenizer, settings.chat_template, engine.max_model_len))

    fields = FieldReporter()

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        headers = fields.check(req)
        response = await create_completion(serving, req, request)
        response.headers.update(headers)
        return response

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        headers = fields.check(req)
        response = await create_chat_completion(
            serving, req, request, settings.chat_template, settings.tool_call_parser
        )
        response.headers.update(headers)
        return response

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> JSONResponse:
        fields.check(req)
        serving.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "send exactly one of `prompt` or `messages`", param="prompt")
        if req.messages is not None:
            tokens = serving.chat_prompt(req.messages, req.add_generation_prompt, settings.chat_template).token_ids
        else:
            tokens = serving.tokenizer.encode(req.prompt or "", add_special_tokens=req.add_special_tokens)
        body = TokenizeResponse(count=len(tokens), max_model_len=engine.max_model_len, tokens=list(tokens))
        return JSONResponse(body.model_dump())

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> JSONResponse:
        serving.check_model(req.model)
        if req.tokens:
            serving.completion_prompts(req.tokens)  # 400 on ids outside the vocabulary
        text = serving.tokenizer.decode(req.tokens, skip_special_tokens=False)
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        await _refresh_kv_stats(serving, engine)
        return Response(serving.metrics.render(), media_type=CONTENT_TYPE)


async def _refresh_kv_stats(serving: Serving, engine: AsyncEngine) -> None:
    """Read the KV tier stats on the engine thread; on a dead or stuck loop keep the last ones."""
    try:
        stats = await asyncio.wait_for(
            engine.run_in_engine(lambda e: e.kv_tier_stats().as_dict()), timeout=KV_STATS_TIMEOUT_S
        )
    except (EngineDeadError, TimeoutError):
        return
    serving.metrics.kv_tiers = stats


def tokenizer_description(tokenizer: Any, chat_template: str | None, max_model_len: int) -> dict[str, Any]:
    specials = tokenizer.specials
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": specials.bos_token,
        "eos_token": specials.eos_token,
        "pad_token": specials.pad_token,
        "unk_token": specials.unk_token,
        "vocab_size": int(tokenizer.vocab_size),
        "model_max_length": max_model_len,
        "chat_template": chat_template if chat_template is not None else tokenizer.chat_template,
    }


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = ".".join(loc) or None
        message = "; ".join(_describe(e) for e in errors) or "invalid request"
        return JSONResponse(error_body(message, "invalid_request_error", None, param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), type_, None, None), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error while serving a request")
        return JSONResponse(error_body(f"internal error: {exc!r}", "server_error"), status_code=500)


def _describe(error: dict[str, object]) -> str:
    loc = ".".join(str(p) for p in error.get("loc", ()) if p != "body")  # type: ignore[attr-defined]
    return f"{loc}: {error.get('msg')}" if loc else str(error.get("msg"))
