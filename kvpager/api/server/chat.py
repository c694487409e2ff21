"""POST /v1/chat/completions: chat through the model's Jinja2 chat template, streamed (SSE) or not."""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvpager.api.server.errors import ApiError
from kvpager.api.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    DeltaMessage,
    error_body,
)
from kvpager.api.server.serving import EngineStreamingResponse, Finals, RequestStream, Serving, new_id, sse
from kvpager.core.outputs import PositionLogprobs


async def create_chat_completion(
    serving: Serving, req: ChatCompletionRequest, request: Request, default_template: str | None
) -> Response:
    """Validate, render the chat prompt, start the engine request, and answer (JSON or SSE)."""
    model = serving.check_model(req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    prompt = await serving.chat_prompt_async(req.messages, req.add_generation_prompt, default_template)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = serving.sampling_params(req, serving.max_tokens(requested, len(prompt.token_ids)), logprobs)
    request_id = new_id("chatcmpl")
    streams = await serving.start(request_id, [prompt], [params])
    if req.stream:
        body = _stream(serving, req, request_id, model, streams)
        return EngineStreamingResponse(body, streams)
    finals = await serving.collect(streams, request)
    choices = [
        ChatChoice(
            index=o.index,
            message=ChatResponseMessage(content=o.text),
            logprobs=_logprobs(serving, o.logprobs) if req.logprobs else None,
            finish_reason=o.finish_reason,
            stop_reason=o.stop_reason,
        )
        for _, o in sorted(finals.outputs.items())
    ]
    response = ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=finals.usage())
    return JSONResponse(response.model_dump())


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


async def _stream(
    serving: Serving, req: ChatCompletionRequest, request_id: str, model: str, streams: list[RequestStream]
) -> AsyncIterator[str]:
    def chunk(choices: list[ChatChunkChoice]) -> str:
        payload = ChatCompletionChunk(id=request_id, model=model, choices=choices).model_dump()
        for choice in payload["choices"]:  # OpenAI sends only the delta fields that are set
            choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
        return sse(payload)

    finals = Finals()
    done: set[int] = set()
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
                choice = ChatChunkChoice(
                    index=o.index,
                    delta=DeltaMessage(content=o.delta_text),
                    logprobs=_logprobs(serving, o.delta_logprobs) if req.logprobs else None,
                    finish_reason=o.finish_reason,
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
