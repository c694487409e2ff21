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
from pathlib import PurePath
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from kvpager.api.server.chat import create_chat_completion
from kvpager.api.server.completions import create_completion
from kvpager.api.server.disagg import ROLES, PrefillClient, PrefillSettings
from kvpager.api.server.errors import ApiError, ApiKeyMiddleware, BodyLimit, BodyLimitMiddleware, CookieAuth
from kvpager.api.server.fields import FieldReporter
from kvpager.api.server.kv_routes import DEFAULT_MAX_KV_IMPORT_BYTES, IMPORT_DISABLED, IMPORT_PATH, add_kv_routes
from kvpager.api.server.kv_view import (
    ASSETS,
    COOKIE_NAME,
    COOKIE_PATHS,
    LOGIN_PATH,
    LOGOUT_PATH,
    OPEN_VIEW_PATHS,
    PAGE_PATH,
    STREAM_PATH,
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
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    error_body,
)
from kvpager.api.server.serving import OFFLOAD_CHARS, Serving
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
    # KV import trust (docs/security.md): /v1/kv/import answers 403 unless enabled; imports, over HTTP
    # or fetched by the decode role, must be signed with the HMAC key shared by the pair.
    enable_kv_import: bool = False
    kv_transfer_key: str | None = None

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
        if self.kv_transfer_key is not None and not self.kv_transfer_key:
            raise ValueError("--kv-transfer-key must not be empty")
        if self.enable_kv_import and not self.kv_transfer_key:
            raise ValueError(
                "--enable-kv-import needs --kv-transfer-key KEY (imports must be signed by a peer holding the key; "
                "see docs/security.md)"
            )
        if self.role == "decode" and not self.kv_transfer_key:
            raise ValueError(
                "--role decode needs --kv-transfer-key KEY, the same key as its prefill server's, so that it "
                "imports only KV its prefill server signed (see docs/security.md)"
            )


def build_app(
    engine: AsyncEngine, settings: ServerSettings, prefill_transport: httpx.AsyncBaseTransport | None = None
) -> FastAPI:
    """The ASGI app serving `engine`; the engine loop starts with the app (idempotent).

    `prefill_transport` carries the decode role's KV fetches instead of a socket (a Ray Serve handle
    to the prefill deployment, `api/replicas/prefill_pool.py`).
    """
    names = list(settings.served_model_names) or [engine.model_name]
    prefill = None
    if settings.prefill is not None:
        prefill = PrefillClient(
            settings.prefill,
            int(engine.config.block_size),
            settings.max_kv_import_bytes,
            settings.kv_transfer_key,
            transport=prefill_transport,
        )
    metrics = ServerMetrics(
        engine.stats, metrics_model_label(settings, names), prefill.stats.as_dict if prefill else None
    )
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
    add_kv_routes(app, serving, engine, settings.chat_template, settings.max_kv_import_bytes, settings.kv_transfer_key)
    remote = prefill.stats.as_dict if prefill is not None else None
    app.state.kv_sampler = KVMapSampler(engine, remote, model_name=metrics_model_label(settings, names))
    add_kv_view_routes(app, app.state.kv_sampler, settings.api_key)
    _customize_openapi(app)
    # NOTE: middleware added last runs first: the key check, then the body size, then FastAPI. So no
    # body is read before the request is authenticated, and none is parsed before its size is checked.
    kv_limit = BodyLimit(settings.max_kv_import_bytes, "--max-kv-import-bytes")
    route_limits = {IMPORT_PATH: kv_limit} if settings.enable_kv_import else {}
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_body_bytes, route_limits=route_limits)
    import_keys = [settings.kv_transfer_key] if settings.enable_kv_import and settings.kv_transfer_key else []
    disabled = {} if settings.enable_kv_import else {IMPORT_PATH: IMPORT_DISABLED}
    app.add_middleware(
        ApiKeyMiddleware,
        api_key=settings.api_key,
        open_paths=OPEN_PATHS | OPEN_VIEW_PATHS,
        path_keys={IMPORT_PATH: import_keys} if import_keys else {},
        disabled_paths=disabled,
        cookie=CookieAuth(COOKIE_NAME, cookie_token(settings.api_key), COOKIE_PATHS) if settings.api_key else None,
    )
    return app


def metrics_model_label(settings: ServerSettings, names: list[str]) -> str:
    """The `model_name` label of /metrics: the served name, or the model directory's last part (the
    unauthenticated /metrics must not show where the model lives on the server's disk)."""
    if settings.served_model_names:
        return names[0]
    return PurePath(names[0]).name or names[0]


def _add_routes(app: FastAPI, serving: Serving, engine: AsyncEngine, settings: ServerSettings) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        if engine.is_running:
            return JSONResponse({"status": "ok"})
        return JSONResponse(error_body("the engine loop is not running", "server_error", "engine_dead"), 503)

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
            prompt = await serving.chat_prompt_async(req.messages, req.add_generation_prompt, settings.chat_template)
            tokens = prompt.token_ids
        else:
            text = req.prompt or ""
            add_special = req.add_special_tokens
            if len(text) > OFFLOAD_CHARS:
                tokens = await asyncio.to_thread(serving.encode, text, add_special)
            else:
                tokens = serving.encode(text, add_special)
        body = TokenizeResponse(count=len(tokens), max_model_len=engine.max_model_len, tokens=list(tokens))
        return JSONResponse(body.model_dump())

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> JSONResponse:
        serving.check_model(req.model)
        text = await serving.detokenize_async(req.tokens)
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        await _refresh_kv_stats(serving, engine)
        return Response(serving.metrics.render(), media_type=CONTENT_TYPE)


async def _refresh_kv_stats(serving: Serving, engine: AsyncEngine) -> None:
    """Read the KV tier stats on the engine thread; on a dead or stuck loop keep the last ones."""
    try:
        stats, fallbacks = await asyncio.wait_for(
            engine.run_in_engine(lambda e: (e.kv_tier_stats().as_dict(), e.kernel_fallbacks())),
            timeout=KV_STATS_TIMEOUT_S,
        )
    except (EngineDeadError, TimeoutError):
        return
    serving.metrics.kv_tiers = stats
    serving.metrics.kernel_fallbacks = fallbacks


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


# Error responses every operation may give, in OpenAI's error shape (validation errors are 400, not
# FastAPI's default 422), so the published schema matches what the server answers.
_ERROR_RESPONSES = {
    "400": "Invalid request (OpenAI-shaped error)",
    "401": "Missing or wrong API key",
    "403": "Route disabled",
    "404": "Unknown model or route",
    "413": "Request body too large",
    "499": "Client disconnected",
    "503": "Queue full (Retry-After) or engine not running",
}


# Content types of the 200 answers that are not (only) JSON.
_SUCCESS_CONTENT = {
    "/v1/completions": ("application/json", "text/event-stream"),
    "/v1/chat/completions": ("application/json", "text/event-stream"),
    "/metrics": ("text/plain",),
    "/v1/kv/export": ("application/octet-stream",),
    "/": ("text/html",),
    PAGE_PATH: ("text/html",),
    STREAM_PATH: ("text/event-stream",),
    **{path: (media.split(";")[0],) for path, (_, media) in ASSETS.items()},
}
# Routes that answer 204 No Content on success.
_NO_CONTENT = frozenset({LOGIN_PATH, LOGOUT_PATH})


def _customize_openapi(app: FastAPI) -> None:
    """Publish the error responses the server really gives; drop FastAPI's 422 (always 400 here)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components["ErrorResponse"] = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
            for nested, definition in components["ErrorResponse"].pop("$defs", {}).items():
                components.setdefault(nested, definition)
            error_ref = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
            for path, operations in schema.get("paths", {}).items():
                for operation in operations.values():
                    responses = operation.setdefault("responses", {})
                    if path in _NO_CONTENT:
                        responses.pop("200", None)
                        responses["204"] = {"description": "No Content"}
                    if path in _SUCCESS_CONTENT:
                        responses.setdefault("200", {"description": "Successful Response"})["content"] = {
                            media: {"schema": {}} for media in _SUCCESS_CONTENT[path]
                        }
                    responses.pop("422", None)
                    for status, description in _ERROR_RESPONSES.items():
                        responses.setdefault(status, {"description": description, "content": error_ref})
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


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
