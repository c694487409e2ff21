"""POST /v1/completions: OpenAI's legacy completions, streamed (SSE) or not."""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvpager.api.server.errors import ApiError
from kvpager.api.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    error_body,
)
from kvpager.api.server.serving import EngineStreamingResponse, Finals, Prompt, RequestStream, Serving, new_id, sse
from kvpager.core.outputs import CompletionOutput, PositionLogprobs


async def create_completion(serving: Serving, req: CompletionRequest, request: Request) -> Response:
    """Validate, start the engine requests, and answer (JSON or an SSE stream)."""
    model = serving.check_model(req.model)
    if req.suffix:
        raise ApiError(400, "suffix is not supported", param="suffix")
    if req.echo and req.logprobs is not None:
        raise ApiError(400, "echo with logprobs is not supported (prompt logprobs are not computed)", param="echo")
    prompts = await serving.completion_prompts_async(req.prompt, req.n)
    params = [
        serving.sampling_params(req, serving.max_tokens(req.max_tokens, len(p.token_ids)), req.logprobs)
        for p in prompts
    ]
    request_id = new_id("cmpl")
    streams = await serving.start(request_id, prompts, params)
    if req.stream:
        body = _stream(serving, req, request_id, model, prompts, streams)
        return EngineStreamingResponse(body, streams)
    finals = await serving.collect(streams, request)
    choices = [
        _choice(serving, req, i * req.n + o.index, o, _echo(serving, req, prompts[i]) + o.text, o.logprobs, 0)
        for (i, _), o in sorted(finals.outputs.items())
    ]
    response = CompletionResponse(id=request_id, model=model, choices=choices, usage=finals.usage())
    return JSONResponse(response.model_dump())


def _echo(serving: Serving, req: CompletionRequest, prompt: Prompt) -> str:
    """The prompt text to put before the completion when `echo` is set."""
    if not req.echo:
        return ""
    return prompt.text if prompt.text is not None else str(serving.tokenizer.decode(prompt.token_ids))


def _choice(
    serving: Serving,
    req: CompletionRequest,
    index: int,
    out: CompletionOutput,
    text: str,
    logprobs: list[PositionLogprobs] | None,
    text_offset: int,
) -> CompletionChoice:
    lp = None
    if req.logprobs is not None:
        # NOTE: echo and logprobs are exclusive (checked up front), so offsets count generated text only.
        lp = _legacy_logprobs(serving, logprobs or [], text_offset)
    return CompletionChoice(
        index=index,
        text=text,
        logprobs=lp,
        finish_reason=out.finish_reason,
        stop_reason=out.stop_reason,
    )


def _legacy_logprobs(serving: Serving, positions: list[PositionLogprobs], offset: int) -> CompletionLogprobs:
    """OpenAI's legacy shape: parallel lists of tokens, their logprobs, top-k dicts and offsets."""
    lp = CompletionLogprobs()
    for pos in positions:
        token = serving.token_text(pos.token_id)
        lp.tokens.append(token)
        lp.token_logprobs.append(max(pos.logprob, -9999.0))
        top = {serving.token_text(t): max(v, -9999.0) for t, v in pos.top}
        top.setdefault(token, max(pos.logprob, -9999.0))
        lp.top_logprobs.append(top)
        lp.text_offset.append(offset)
        offset += len(token)
    return lp


async def _stream(
    serving: Serving,
    req: CompletionRequest,
    request_id: str,
    model: str,
    prompts: list[Prompt],
    streams: list[RequestStream],
) -> AsyncIterator[str]:
    finals = Finals()
    offsets: dict[int, int] = {}  # choice index -> characters sent so far
    done: set[int] = set()
    echoed: set[int] = set()
    try:
        async for i, out in serving.merged(streams):
            finals.update(i, out)
            for o in out.outputs:
                index = i * req.n + o.index
                if index in done or not (o.delta_text or o.delta_token_ids or o.finished):
                    continue
                prefix = "" if index in echoed else _echo(serving, req, prompts[i])
                echoed.add(index)
                offset = offsets.get(index, 0)
                choice = _choice(serving, req, index, o, prefix + o.delta_text, o.delta_logprobs, offset)
                offsets[index] = offset + len(choice.text)
                if o.finished:
                    done.add(index)
                chunk = CompletionResponse(id=request_id, model=model, choices=[choice])
                yield sse(chunk.model_dump())
    except ApiError as exc:
        yield sse(exc.body())
    except Exception as exc:  # the engine failed mid-stream: tell the client in-band
        yield sse(error_body(f"the engine failed: {exc}", "server_error"))
    else:
        if req.stream_options is not None and req.stream_options.include_usage:
            yield sse(CompletionResponse(id=request_id, model=model, choices=[], usage=finals.usage()).model_dump())
    yield "data: [DONE]\n\n"
