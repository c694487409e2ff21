"""POST /v1/completions: OpenAI's legacy completions, streamed (SSE) or not.

`echo` with `logprobs` returns the prompt tokens' logprobs (the first is null: it has no context)
before the generated ones, as OpenAI and vLLM do; `max_tokens=0` with `echo` scores the prompt
without generating (the engine samples one token, which is dropped). vLLM's `prompt_logprobs=N`
adds its `prompt_logprobs` list to each choice.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvpager.api.server.errors import ApiError
from kvpager.api.server.guided import structured_spec
from kvpager.api.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptLogprob,
    error_body,
)
from kvpager.api.server.serving import EngineStreamingResponse, Finals, Prompt, RequestStream, Serving, new_id, sse
from kvpager.core.outputs import CompletionOutput, PositionLogprobs, RequestOutput


async def create_completion(serving: Serving, req: CompletionRequest, request: Request) -> Response:
    """Validate, start the engine requests, and answer (JSON or an SSE stream)."""
    model = serving.check_model(req.model)
    if req.suffix:
        raise ApiError(400, "suffix is not supported", param="suffix")
    if req.max_tokens == 0 and not req.echo:
        raise ApiError(
            400, "max_tokens=0 needs echo=true (it scores the prompt without generating)", param="max_tokens"
        )
    prompts = serving.completion_prompts(req.prompt)
    structured = structured_spec(req)
    if structured is not None:
        await serving.compile_grammar(structured)
    engine_max = 1 if req.max_tokens == 0 else req.max_tokens
    params = [
        serving.sampling_params(
            req,
            serving.max_tokens(engine_max, len(p.token_ids)),
            req.logprobs,
            prompt_logprobs=_prompt_k(req),
            structured=structured,
        )
        for p in prompts
    ]
    request_id = new_id("cmpl")
    streams = await serving.start(request_id, prompts, params)
    if req.stream:
        body = _stream(serving, req, request_id, model, prompts, streams)
        return EngineStreamingResponse(body, streams)
    finals = await serving.collect(streams, request)
    choices = []
    for (i, _), o in sorted(finals.outputs.items()):
        o = _scored_only(o) if req.max_tokens == 0 else o
        choices.append(_choice(serving, req, i * req.n + o.index, o, prompts[i], finals.prompt_lp.get(i), True))
    usage = finals.usage(count_completion=req.max_tokens != 0)
    return JSONResponse(CompletionResponse(id=request_id, model=model, choices=choices, usage=usage).model_dump())


def _prompt_k(req: CompletionRequest) -> int | None:
    """How many top alternatives each prompt position needs (None: no prompt logprobs)."""
    wants = [k for k in (req.prompt_logprobs, req.logprobs if req.echo else None) if k is not None]
    return max(wants) if wants else None


def _scored_only(out: CompletionOutput) -> CompletionOutput:
    """max_tokens=0: the engine's one sampled token is not part of the answer."""
    return CompletionOutput(index=out.index, finish_reason="length", logprobs=[] if out.logprobs is not None else None)


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
    prompt: Prompt,
    prompt_lp: list[PositionLogprobs | None] | None,
    first: bool,
    text_offset: int = 0,
) -> CompletionChoice:
    """One choice; `first` is the chunk that carries the echoed prompt (always, when not streaming)."""
    echo = _echo(serving, req, prompt) if first else ""
    text = echo + (out.text if not req.stream else out.delta_text)
    generated = out.logprobs if not req.stream else out.delta_logprobs
    lp = None
    if req.logprobs is not None:
        lp = CompletionLogprobs()
        if req.echo and first:
            _legacy_prompt(serving, lp, prompt.token_ids, prompt_lp, req.logprobs)
        _legacy_generated(serving, lp, generated or [])
        offset = text_offset
        for token in lp.tokens:
            lp.text_offset.append(offset)
            offset += len(token)
    vllm_prompt = None
    if req.prompt_logprobs is not None and first and prompt_lp is not None:
        vllm_prompt = [_vllm_position(serving, pos, req.prompt_logprobs) for pos in prompt_lp]
    return CompletionChoice(
        index=index,
        text=text,
        logprobs=lp,
        prompt_logprobs=vllm_prompt,
        finish_reason=out.finish_reason,
        stop_reason=out.stop_reason,
    )


def _legacy_prompt(
    serving: Serving, lp: CompletionLogprobs, ids: list[int], positions: list[PositionLogprobs | None] | None, k: int
) -> None:
    if positions is None or len(positions) != len(ids):
        raise ApiError(500, "prompt logprobs are missing from the engine output")
    for token_id, pos in zip(ids, positions, strict=True):
        token = serving.token_text(token_id)
        lp.tokens.append(token)
        if pos is None:
            lp.token_logprobs.append(None)
            lp.top_logprobs.append(None)
            continue
        lp.token_logprobs.append(max(pos.logprob, -9999.0))
        top = {serving.token_text(t): max(v, -9999.0) for t, v in pos.top[:k]}
        top.setdefault(token, max(pos.logprob, -9999.0))
        lp.top_logprobs.append(top)


def _legacy_generated(serving: Serving, lp: CompletionLogprobs, positions: list[PositionLogprobs]) -> None:
    """OpenAI's legacy shape: parallel lists of tokens, their logprobs and top-k dicts."""
    for pos in positions:
        token = serving.token_text(pos.token_id)
        lp.tokens.append(token)
        lp.token_logprobs.append(max(pos.logprob, -9999.0))
        top = {serving.token_text(t): max(v, -9999.0) for t, v in pos.top}
        top.setdefault(token, max(pos.logprob, -9999.0))
        lp.top_logprobs.append(top)


def _vllm_position(serving: Serving, pos: PositionLogprobs | None, k: int) -> dict[str, PromptLogprob] | None:
    """vLLM's prompt_logprobs entry: token id -> {logprob, rank, decoded_token}, the prompt token first."""
    if pos is None:
        return None
    entry = {
        str(pos.token_id): PromptLogprob(
            logprob=pos.logprob, rank=pos.rank, decoded_token=serving.token_text(pos.token_id)
        )
    }
    for rank, (token_id, value) in enumerate(pos.top[:k], start=1):
        entry.setdefault(
            str(token_id), PromptLogprob(logprob=value, rank=rank, decoded_token=serving.token_text(token_id))
        )
    return entry


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
    try:
        async for i, out in serving.merged(streams):
            finals.update(i, out)
            for o in out.outputs:
                index = i * req.n + o.index
                if index in done or not (o.delta_text or o.delta_token_ids or o.finished):
                    continue
                if req.max_tokens == 0:
                    o = _scored_only(o)
                first = index not in offsets
                offset = offsets.get(index, 0)
                choice = _choice(serving, req, index, o, prompts[i], _prompt_lp(out), first, offset)
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
            usage = finals.usage(count_completion=req.max_tokens != 0)
            yield sse(CompletionResponse(id=request_id, model=model, choices=[], usage=usage).model_dump())
    yield "data: [DONE]\n\n"


def _prompt_lp(out: RequestOutput) -> list[PositionLogprobs | None] | None:
    return out.prompt_logprobs
