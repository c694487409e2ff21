"""POST /v1/chat/completions: chat through the model's Jinja2 chat template, streamed (SSE) or not.

Structured output (`response_format`, vLLM's guided_* / structured_outputs) and tools (see
`tools.py`) are decoding constraints or output parsers on top of the same engine request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvpager.api.server.errors import ApiError
from kvpager.api.server.guided import structured_spec
from kvpager.api.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ResponseToolCall,
    error_body,
)
from kvpager.api.server.serving import EngineStreamingResponse, Finals, Prompt, RequestStream, Serving, new_id, sse
from kvpager.api.server.tools import (
    ToolPlan,
    held_back,
    new_call_id,
    plan_tools,
    template_messages,
    template_tools,
    tool_call_start,
    tool_calls_of,
)
from kvpager.core.outputs import PositionLogprobs

RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "chat_template", "documents"})


async def create_chat_completion(
    serving: Serving,
    req: ChatCompletionRequest,
    request: Request,
    default_template: str | None,
    tool_parser: str | None = None,
) -> Response:
    """Validate, render the chat prompt, start the engine request, and answer (JSON or SSE)."""
    model = serving.check_model(req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    plan = plan_tools(req, tool_parser)
    structured = structured_spec(req)
    if plan.constraint is not None:
        if structured is not None:
            raise ApiError(
                400, "tool_choice required/named cannot be combined with response_format", param="tool_choice"
            )
        structured = plan.constraint
    prompt = _prompt(serving, req, default_template)
    if structured is not None:
        await serving.compile_grammar(structured)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = serving.max_tokens(requested, len(prompt.token_ids))
    params = serving.sampling_params(req, max_tokens, logprobs, structured=structured)
    request_id = new_id("chatcmpl")
    streams = await serving.start(request_id, [prompt], [params])
    if req.stream:
        body = _stream(serving, req, request_id, model, streams, plan, tool_parser)
        return EngineStreamingResponse(body, streams)
    finals = await serving.collect(streams, request)
    choices = []
    for _, o in sorted(finals.outputs.items()):
        content, calls = tool_calls_of(plan, o.text, tool_parser)
        choices.append(
            ChatChoice(
                index=o.index,
                message=ChatResponseMessage(content=content, tool_calls=calls),
                logprobs=_logprobs(serving, o.logprobs) if req.logprobs else None,
                finish_reason="tool_calls" if calls else o.finish_reason,
                stop_reason=o.stop_reason,
            )
        )
    response = ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=finals.usage())
    return JSONResponse(response.model_dump())


def _prompt(serving: Serving, req: ChatCompletionRequest, template: str | None) -> Prompt:
    """The rendered chat prompt: messages (tool calls and results too), tools, template kwargs."""
    kwargs = dict(req.chat_template_kwargs or {})
    bad = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if bad:
        raise ApiError(400, f"chat_template_kwargs may not set {', '.join(bad)}", param="chat_template_kwargs")
    try:
        messages = template_messages(req)
    except ValueError as exc:
        raise ApiError(400, str(exc), param="messages") from exc
    tools = template_tools(req)
    if tools is not None:
        kwargs["tools"] = tools
    text = serving.render_dicts(messages, req.add_generation_prompt, template, kwargs)
    return Prompt(serving.tokenizer.encode(text, add_special_tokens=False), text)


def _logprobs(serving: Serving, positions: list[PositionLogprobs] | None) -> ChatLogprobs:
    content = []
    for pos in positions or []:
        token = serving.token_text(pos.token_id)
        content.append(
            ChatTokenLogprob(
                token=token,
                logprob=max(pos.logprob, -9999.0),
                bytes=list(token.encode("utf-8")),
                top_logprobs=serving.top_logprobs(pos),
            )
        )
    return ChatLogprobs(content=content)


class _ToolStream:
    """Per choice: turns text deltas into content and tool-call deltas, as OpenAI streams them."""

    def __init__(self, plan: ToolPlan, parser: str | None) -> None:
        self.plan = plan
        self.parser = parser
        self.text = ""  # everything generated
        self.sent = 0  # characters of `text` already sent as content
        self.in_call = False  # auto: the model started its tool-call syntax
        self.call_id = new_call_id()
        self.opened = False  # named: the first tool-call delta (id, name) was sent

    def feed(self, delta: str, finished: bool) -> tuple[str | None, list[DeltaToolCall]]:
        """(content delta, tool-call deltas) for one engine delta."""
        self.text += delta
        mode = self.plan.mode
        if mode == "named":
            calls: list[DeltaToolCall] = []
            if not self.opened:
                self.opened = True
                fn = DeltaFunctionCall(name=self.plan.name, arguments="")
                calls.append(DeltaToolCall(index=0, id=self.call_id, type="function", function=fn))
            if delta:
                calls.append(DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=delta)))
            return None, calls
        if mode == "required":
            return None, self._final_calls() if finished else []
        if mode != "auto" or self.parser is None:
            return (delta or None), []
        if not self.in_call and tool_call_start(self.parser, self.text) is not None:
            self.in_call = True
        if not self.in_call:
            keep = 0 if finished else held_back(self.parser, self.text)
            out = self.text[self.sent : len(self.text) - keep]
            self.sent += len(out)
            return (out or None), []
        if not finished:
            return None, []
        _, parsed = tool_calls_of(self.plan, self.text, self.parser)
        end = (tool_call_start(self.parser, self.text) or 0) if parsed else len(self.text)
        rest = self.text[self.sent : end]  # content the held-back text still owes the client
        return (rest or None), self._deltas(parsed)

    def _final_calls(self) -> list[DeltaToolCall]:
        _, calls = tool_calls_of(self.plan, self.text, self.parser)
        return self._deltas(calls)

    @staticmethod
    def _deltas(calls: list[ResponseToolCall]) -> list[DeltaToolCall]:
        return [
            DeltaToolCall(
                index=i,
                id=c.id,
                type="function",
                function=DeltaFunctionCall(name=c.function.name, arguments=c.function.arguments),
            )
            for i, c in enumerate(calls)
        ]


async def _stream(
    serving: Serving,
    req: ChatCompletionRequest,
    request_id: str,
    model: str,
    streams: list[RequestStream],
    plan: ToolPlan,
    parser: str | None,
) -> AsyncIterator[str]:
    def chunk(choices: list[ChatChunkChoice]) -> str:
        payload = ChatCompletionChunk(id=request_id, model=model, choices=choices).model_dump(exclude_none=False)
        for choice in payload["choices"]:  # OpenAI sends only the delta fields that are set
            choice["delta"] = _drop_none(choice["delta"])
        return sse(payload)

    finals = Finals()
    done: set[int] = set()
    tool_streams = {i: _ToolStream(plan, parser) for i in range(req.n)}
    any_calls: set[int] = set()
    try:
        # OpenAI sends the role first, in a chunk of its own per choice.
        for index in range(req.n):
            yield chunk([ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
        async for _, out in serving.merged(streams):
            finals.update(0, out)
            for o in out.outputs:
                if o.index in done or not (o.delta_text or o.delta_token_ids or o.finished):
                    continue
                if o.finished:
                    done.add(o.index)
                content, calls = tool_streams[o.index].feed(o.delta_text, o.finished)
                if calls:
                    any_calls.add(o.index)
                reason = o.finish_reason
                if reason is not None and o.index in any_calls:
                    reason = "tool_calls"
                choice = ChatChunkChoice(
                    index=o.index,
                    delta=DeltaMessage(content=content, tool_calls=calls or None),
                    logprobs=_logprobs(serving, o.delta_logprobs) if req.logprobs else None,
                    finish_reason=reason,
                    stop_reason=o.stop_reason,
                )
                yield chunk([choice])
    except ApiError as exc:
        yield sse(exc.body())
    except Exception as exc:  # the engine failed mid-stream: tell the client in-band
        yield sse(error_body(f"the engine failed: {exc}", "server_error"))
    else:
        if req.stream_options is not None and req.stream_options.include_usage:
            usage = ChatCompletionChunk(id=request_id, model=model, choices=[], usage=finals.usage())
            yield sse(usage.model_dump())
    yield "data: [DONE]\n\n"


def _drop_none(value: Any) -> Any:
    """OpenAI omits unset fields in stream deltas (nested tool-call deltas too)."""
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value
