"""OpenAI-shaped HTTP errors and the ASGI middleware that guards every request.

Every error leaves the server as `{"error": {"message", "type", "param", "code"}}`. The API-key and
body-size checks run as plain ASGI middleware, in that order, before FastAPI reads or parses the
body: an unauthenticated request is answered before a byte of its body is read (so it cannot make
the server buffer up to a body limit), and an oversized one can never reach the engine.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpager.api.server.protocol import error_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class ApiError(Exception):
    """An error the server answers with `status` and an OpenAI-shaped body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | int | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, _TYPES.get(self.status, "invalid_request_error"), self.code, self.param)


async def send_error(send: Send, error: ApiError) -> None:
    """Write `error` as a complete JSON response on a raw ASGI connection."""
    payload = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": payload, "more_body": False})


@dataclass(frozen=True)
class BodyLimit:
    """A request-body size bound and the flag that raises it (named in the 413 message)."""

    max_bytes: int
    flag: str = "--max-request-body-bytes"


class BodyLimitMiddleware:
    """Answers 413 when a request body exceeds its route's limit, before anything parses it.

    `max_bytes` bounds every path not in `route_limits` (e.g. `/v1/kv/import`, whose KV payloads
    are far larger than any JSON request, has a limit of its own).
    NOTE: the body is read (up to the limit) and replayed to the app; after the replay, `receive`
    goes back to the server's own, so the app still sees `http.disconnect` when the client leaves.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, route_limits: Mapping[str, BodyLimit] | None = None) -> None:
        self.app = app
        self.default = BodyLimit(max_bytes)
        self.route_limits = dict(route_limits or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.route_limits.get(scope.get("path", ""), self.default)
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit.max_bytes:
            await send_error(send, _too_large(int(declared), limit))
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending the body
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit.max_bytes:
                await send_error(send, _too_large(size, limit))
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def _too_large(size: int, limit: BodyLimit) -> ApiError:
    return ApiError(
        413,
        f"Request body of {size} bytes exceeds the limit of {limit.max_bytes} bytes (raise it with {limit.flag}).",
        code="request_too_large",
    )


@dataclass(frozen=True)
class CookieAuth:
    """A cookie that stands in for the key on a few GET paths (the /kv page's login, see kv_view.py)."""

    name: str
    value: str
    paths: frozenset[str]


class ApiKeyMiddleware:
    """Answers 401 unless `Authorization: Bearer <key>` holds an accepted key, before any body is read.

    `api_key` guards every path but `open_paths` (None: the API is open). `path_keys` names further
    keys a path accepts (e.g. `--kv-transfer-key` on `/v1/kv/import`); a path listed there is guarded
    even when there is no API key. `disabled_paths` answer 403 with their message, unread (a route
    turned off by a flag, such as `/v1/kv/import` without `--enable-kv-import`). Keys are compared as
    UTF-8 bytes in constant time, so non-ASCII keys work. With `cookie`, a GET to one of
    `cookie.paths` carrying that cookie passes too.
    """

    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        open_paths: frozenset[str],
        path_keys: Mapping[str, Sequence[str]] | None = None,
        disabled_paths: Mapping[str, str] | None = None,
        cookie: CookieAuth | None = None,
    ) -> None:
        self.app = app
        self.api_key = api_key
        self.open_paths = open_paths
        self.cookie = cookie
        self.path_keys = {path: [k.encode("utf-8") for k in keys] for path, keys in (path_keys or {}).items()}
        self.disabled_paths = dict(disabled_paths or {})

    def _accepted(self, path: str) -> list[bytes] | None:
        """The keys `path` accepts; None when it is open."""
        keys = [self.api_key.encode("utf-8")] if self.api_key and path not in self.open_paths else []
        if path in self.path_keys:
            return keys + self.path_keys[path]
        return keys or None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if path in self.disabled_paths:
            await send_error(send, ApiError(403, self.disabled_paths[path], code="disabled"))
            return
        accepted = self._accepted(path)
        if accepted is None or self._cookie_ok(scope):
            await self.app(scope, receive, send)
            return
        auth = _header_bytes(scope, b"authorization") or b""
        scheme, _, token = auth.partition(b" ")
        token = token.strip()
        # NOTE: every key is compared (no early exit), so the time taken does not say which one matched.
        matches = [hmac.compare_digest(token, key) for key in accepted]
        if scheme.lower() == b"bearer" and any(matches):
            await self.app(scope, receive, send)
            return
        message = "Missing API key." if not auth else "Incorrect API key provided."
        await send_error(
            send, ApiError(401, message + " Pass it as 'Authorization: Bearer <key>'.", code="invalid_api_key")
        )

    def _cookie_ok(self, scope: Scope) -> bool:
        cookie = self.cookie
        if cookie is None or scope.get("method") != "GET" or scope["path"] not in cookie.paths:
            return False
        for part in (_header(scope, b"cookie") or "").split(";"):
            name, _, value = part.strip().partition("=")
            if name == cookie.name and hmac.compare_digest(value.encode(), cookie.value.encode()):
                return True
        return False


def _header(scope: Scope, name: bytes) -> str | None:
    value = _header_bytes(scope, name)
    return value.decode("latin-1") if value is not None else None


def _header_bytes(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return bytes(value)
    return None
