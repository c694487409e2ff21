"""No silent drops: request fields the server does not know are reported; harmful ones are refused.

The request models keep unknown fields (`extra="allow"`). `unknown_fields` lists them with their
path (`messages[].foo`); `FieldReporter` logs each field name once per server and the routes
return the list in the `x-kvpager-ignored-fields` response header (vLLM logs them too). A field
that would change the result and is not implemented (`best_of` > n, beam search, ...) is a 400
naming it, so a client never gets an answer to a question it did not ask.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from kvpager.api.server.errors import ApiError

logger = logging.getLogger("kvpager.api.server")

IGNORED_FIELDS_HEADER = "x-kvpager-ignored-fields"
MAX_REPORTED_FIELDS = 32  # names listed in one response's header
MAX_LOGGED_FIELDS = 256  # distinct names logged over the server's life
MAX_FIELD_NAME_CHARS = 64


def _truthy(value: Any, _: BaseModel) -> bool:
    return bool(value)


def _best_of(value: Any, req: BaseModel) -> bool:
    return value is not None and value != getattr(req, "n", 1)


def _not_text_only(value: Any, _: BaseModel) -> bool:
    return value is not None and list(value) != ["text"]


# Field -> (refuse when, why). Unknown fields not listed here are ignored and reported.
UNSUPPORTED: dict[str, tuple[Callable[[Any, BaseModel], bool], str]] = {
    "best_of": (_best_of, "best_of != n is not supported (kvpager returns all n samples; send n only)"),
    "use_beam_search": (_truthy, "beam search is not supported"),
    "functions": (_truthy, "the deprecated `functions` field is not supported; send `tools`"),
    "function_call": (_truthy, "the deprecated `function_call` field is not supported; send `tool_choice`"),
    "modalities": (_not_text_only, "only the text modality is supported"),
    "audio": (_truthy, "audio output is not supported"),
    "logits_processors": (_truthy, "custom logits processors are not supported"),
    "bad_words": (_truthy, "bad_words is not supported; use logit_bias with -100"),
    "allowed_token_ids": (_truthy, "allowed_token_ids is not supported; use logit_bias or a guided_* constraint"),
    "truncate_prompt_tokens": (_truthy, "truncate_prompt_tokens is not supported; truncate the prompt yourself"),
    "prompt_embeds": (_truthy, "prompt_embeds is not supported"),
    "continue_final_message": (_truthy, "continue_final_message is not supported"),
}


def unknown_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """Dotted paths of the fields a request carried that its model does not declare (nested too)."""
    found = [f"{prefix}{key}" for key in (model.model_extra or {})]
    for name in type(model).model_fields:
        value = getattr(model, name)
        items = value if isinstance(value, list) else [value]
        for item in items:
            if isinstance(item, BaseModel):
                path = f"{prefix}{name}[]." if isinstance(value, list) else f"{prefix}{name}."
                found.extend(unknown_fields(item, path))
    return sorted(dict.fromkeys(found))


def refuse_unsupported(req: BaseModel) -> None:
    """400 naming the first unknown top-level field that would change the result."""
    for key, value in (req.model_extra or {}).items():
        rule = UNSUPPORTED.get(key)
        if rule is not None and rule[0](value, req):
            raise ApiError(400, f"`{key}`: {rule[1]}", param=key, code="unsupported_field")


class FieldReporter:
    """Logs every ignored field name once (per server, not per request) and builds the header."""

    def __init__(self) -> None:
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    def check(self, req: BaseModel) -> dict[str, str]:
        """Refuse unsupported fields (400); the response headers naming the ignored ones."""
        refuse_unsupported(req)
        ignored = [printable_name(name) for name in unknown_fields(req)[:MAX_REPORTED_FIELDS]]
        if not ignored:
            return {}
        with self._lock:
            new = [name for name in ignored if name not in self._logged]
            # NOTE: bounded: a client inventing field names must not grow the server's memory
            new = new[: max(0, MAX_LOGGED_FIELDS - len(self._logged))]
            self._logged.update(new)
        if new:
            logger.warning("ignoring request fields the server does not support: %s", ", ".join(new))
        return {IGNORED_FIELDS_HEADER: ",".join(ignored)}


def printable_name(name: str) -> str:
    """A field name as printable ASCII for a header and a log line: non-ASCII characters, lone
    surrogates, controls (CR/LF could split a header) and commas escaped as JSON escapes them, at
    most MAX_FIELD_NAME_CHARS long."""
    escaped = json.dumps(name[:MAX_FIELD_NAME_CHARS], ensure_ascii=True)[1:-1]
    return escaped.replace(",", "\\u002c")
