"""Tool calling in chat: `tools` + `tool_choice` (none / auto / required / a named function).

- `required` and a named function constrain decoding (structured output): a named call emits its
  arguments (the function's parameter schema); `required` emits a JSON array of
  `{"name", "parameters"}` objects (vLLM's shape), one of the tools per item.
- `auto` lets the model write its own tool-call syntax, parsed after decoding by the parser that
  `--tool-call-parser` names (vLLM's names: hermes / qwen, llama3_json, mistral).
Tool calls leave as OpenAI `tool_calls` with ids and `finish_reason: "tool_calls"`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from kvpager.api.server.errors import ApiError
from kvpager.api.server.guided import closed_objects
from kvpager.api.server.protocol import ChatCompletionRequest, ResponseFunctionCall, ResponseToolCall
from kvpager.core.sampling_params import StructuredOutputSpec

TOOL_PARSERS = ("hermes", "qwen", "llama3_json", "mistral")
ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    """How a chat request uses tools: `mode` is none | auto | required | named."""

    mode: str
    name: str | None = None  # the named function
    constraint: StructuredOutputSpec | None = None


def plan_tools(req: ChatCompletionRequest, parser: str | None) -> ToolPlan:
    """Validate `tools`/`tool_choice` (400 naming the problem) and decide how to decode."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise ApiError(400, "tool_choice needs a non-empty `tools` list", param="tool_choice")
        return ToolPlan("none")
    if choice is None:
        choice = "auto"
    if choice == "none":
        return ToolPlan("none")
    if choice == "auto":
        if parser is None:
            raise ApiError(
                400,
                '"auto" tool choice needs `kvpager serve --tool-call-parser NAME` (hermes, llama3_json, mistral); '
                'or send tool_choice "required" or a named function',
                param="tool_choice",
            )
        return ToolPlan("auto")
    if choice == "required":
        items = [
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [t.function.name]}, "parameters": _params(t)},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in req.tools
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not req.parallel_tool_calls:
            schema["maxItems"] = 1
        return ToolPlan("required", constraint=StructuredOutputSpec("json", json.dumps(schema, sort_keys=True)))
    if isinstance(choice, str):
        raise ApiError(
            400,
            f'tool_choice must be "none", "auto", "required" or a named function, got {choice!r}',
            param="tool_choice",
        )
    tool = next((t for t in req.tools if t.function.name == choice.function.name), None)
    if tool is None:
        raise ApiError(400, f"tool_choice names {choice.function.name!r}, which is not in `tools`", param="tool_choice")
    spec = StructuredOutputSpec("json", json.dumps(_params(tool), sort_keys=True))
    return ToolPlan("named", name=tool.function.name, constraint=spec)


def _params(tool: Any) -> Any:
    """The function's parameter schema, closed (no invented keys), as the constraint of its arguments."""
    return closed_objects(dict(tool.function.parameters)) if tool.function.parameters else ANY_OBJECT


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_calls_of(plan: ToolPlan, text: str, parser: str | None) -> tuple[str | None, list[ResponseToolCall]]:
    """(content, tool calls) of a finished output under `plan`."""
    if plan.mode == "named":
        assert plan.name is not None
        return None, [_call(plan.name, text)]
    if plan.mode == "required":
        items = complete_items(text)
        if not items:
            return text, []  # cut short (max_tokens) before one call was complete: plain content
        return None, [_call(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in items]
    if plan.mode == "auto" and parser is not None:
        return parse_tool_calls(parser, text)
    return text, []


def complete_items(text: str) -> list[dict[str, Any]]:
    """The complete `{"name", "parameters"}` items of a `required` array, also when max_tokens cut
    the array short (the grammar guarantees every complete item is a valid call)."""
    body = text.strip()
    if not body.startswith("["):
        return []
    decoder = json.JSONDecoder()
    items: list[dict[str, Any]] = []
    at = 1
    while True:
        while at < len(body) and body[at] in " \t\r\n,":
            at += 1
        if at >= len(body) or body[at] == "]":
            return items
        try:
            item, at = decoder.raw_decode(body, at)
        except ValueError:
            return items
        if isinstance(item, dict) and isinstance(item.get("name"), str) and "parameters" in item:
            items.append(item)


def _call(name: str, arguments: str) -> ResponseToolCall:
    return ResponseToolCall(id=new_call_id(), function=ResponseFunctionCall(name=name, arguments=arguments))


# -- the model's own syntax ("auto") -----------------------------------------------------------
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
MARKERS = {"hermes": "<tool_call>", "qwen": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3_json": "<|python_tag|>"}


def tool_call_start(parser: str, text: str) -> int | None:
    """Where the model's tool-call syntax starts in `text`, or None (content so far)."""
    if parser == "llama3_json":
        stripped = text.lstrip()
        if stripped.startswith(("{", MARKERS[parser])):
            return len(text) - len(stripped)
        return None
    at = text.find(MARKERS[parser])
    return at if at >= 0 else None


def held_back(parser: str, text: str) -> int:
    """How many trailing characters of streamed content might be the start of a marker."""
    if parser == "llama3_json":
        return len(text) if not text.strip() else 0
    marker = MARKERS[parser]
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def parse_tool_calls(parser: str, text: str) -> tuple[str | None, list[ResponseToolCall]]:
    """Split a finished output into content and tool calls (invalid calls stay content)."""
    start = tool_call_start(parser, text)
    if start is None:
        return text, []
    content, rest = text[:start], text[start:]
    try:
        raw = _raw_calls(parser, rest)
        calls = [_call(str(c["name"]), _arguments(c)) for c in raw]
    except (ValueError, KeyError, TypeError):
        return text, []
    if not calls:
        return text, []
    return (content if content.strip() else None), calls


def _raw_calls(parser: str, rest: str) -> list[dict[str, Any]]:
    if parser in ("hermes", "qwen"):
        return [json.loads(m) for m in _HERMES.findall(rest) if m.strip()]
    if parser == "mistral":
        payload = json.loads(rest[len(MARKERS["mistral"]) :].strip())
        return payload if isinstance(payload, list) else [payload]
    body = rest.strip().removeprefix(MARKERS["llama3_json"]).strip()
    decoder = json.JSONDecoder()
    calls: list[dict[str, Any]] = []
    while body:
        obj, end = decoder.raw_decode(body)
        calls.append(obj)
        body = body[end:].strip().removeprefix(";").strip()
    return calls


def _arguments(call: dict[str, Any]) -> str:
    args = call.get("arguments", call.get("parameters", {}))
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def template_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: tool calls with parsed arguments, tool results."""
    out: list[dict[str, Any]] = []
    for m in req.messages:
        entry: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name is not None:
            entry["name"] = m.name
        if m.tool_call_id is not None:
            entry["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            entry["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _loads(c.function.arguments)},
                }
                for c in m.tool_calls
            ]
        out.append(entry)
    return out


def _loads(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        raise ApiError(
            400, f"tool call arguments must be a JSON string, got {arguments[:80]!r}", param="messages"
        ) from None


def template_tools(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """`tools` as transformers' apply_chat_template passes them to the template."""
    if not req.tools:
        return None
    return [t.model_dump(exclude_none=True, by_alias=True) for t in req.tools]
