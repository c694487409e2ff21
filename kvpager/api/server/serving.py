"""What completions and chat completions share: prompts, sampling params, engine streams, usage.

`Serving` turns a validated request into engine requests (one per prompt; the engine runs the n
samples of each), and gives back either the final outputs or a merged live stream of them.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import StreamingResponse

from kvpager.api.server.disagg import PrefillClient
from kvpager.api.server.errors import ApiError
from kvpager.api.server.metrics import ServerMetrics
from kvpager.api.server.protocol import (
    ChatMessage,
    PromptInput,
    PromptTokensDetails,
    TopLogprob,
    Usage,
    _SamplingFields,
)
from kvpager.core.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from kvpager.core.sampling_params import SamplingParams, StructuredOutputSpec
from kvpager.engine.async_engine import AsyncEngine, EngineDeadError, QueueFullError, RequestStream

RETRY_AFTER_S = 1


@dataclass(slots=True)
class Prompt:
    """One prompt as the engine sees it; `text` is None when the client sent token ids."""

    token_ids: list[int]
    text: str | None


@dataclass
class Finals:
    """The latest output of every sample, keyed (prompt index, sample index), plus usage counts."""

    outputs: dict[tuple[int, int], CompletionOutput] = field(default_factory=dict)
    prompt_lens: dict[int, int] = field(default_factory=dict)
    cached: dict[int, int] = field(default_factory=dict)
    prompt_lp: dict[int, list[PositionLogprobs | None]] = field(default_factory=dict)

    def update(self, prompt_index: int, out: RequestOutput) -> None:
        self.prompt_lens[prompt_index] = len(out.prompt_token_ids)
        self.cached[prompt_index] = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            self.prompt_lp[prompt_index] = out.prompt_logprobs
        for o in out.outputs:
            self.outputs[(prompt_index, o.index)] = o

    def usage(self, count_completion: bool = True) -> Usage:
        prompt = sum(self.prompt_lens.values())
        completion = sum(len(o.token_ids) for o in self.outputs.values()) if count_completion else 0
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(self.cached.values())),
        )


class Serving:
    """Shared request handling over one AsyncEngine.

    With a `prefill` client (disaggregated decode role), each prompt's KV is fetched from the
    prefill server and imported before the request is added (see `disagg.py`).
    """

    def __init__(
        self,
        engine: AsyncEngine,
        served_names: list[str],
        metrics: ServerMetrics,
        prefill: PrefillClient | None = None,
    ) -> None:
        self.engine = engine
        self.served_names = served_names
        self.metrics = metrics
        self.prefill = prefill

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def check_model(self, name: str | None) -> str:
        """The served name to report; 404 when the client asked for a model we do not serve."""
        if name is None or name == "" or name in self.served_names:
            return self.served_names[0] if not name else name
        raise ApiError(404, f"The model `{name}` does not exist.", code="model_not_found", param="model")

    # -- prompts --------------------------------------------------------------------------------
    def completion_prompts(self, prompt: PromptInput) -> list[Prompt]:
        """Normalise a completions prompt (str, list of str, ids, list of ids) to engine prompts."""
        if isinstance(prompt, str):
            items: list[str | list[int]] = [prompt]
        elif prompt and all(isinstance(x, int) for x in prompt):
            items = [[x for x in prompt if isinstance(x, int)]]
        else:
            items = list(prompt)  # type: ignore[arg-type]
        if not items:
            raise ApiError(400, "prompt must not be empty", param="prompt")
        return [self._prompt(item) for item in items]

    def chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool, template: str | None) -> Prompt:
        """Render the chat template and tokenize it (the template carries any special tokens)."""
        text = self.render_chat(messages, add_generation_prompt, template)
        return Prompt(self.tokenizer.encode(text, add_special_tokens=False), text)

    def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool, template: str | None) -> str:
        try:
            dicts = [{"role": m.role, "content": m.text()} for m in messages]
        except ValueError as exc:
            raise ApiError(400, str(exc), param="messages") from exc
        return self.render_dicts(dicts, add_generation_prompt, template)

    def render_dicts(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        template: str | None,
        variables: dict[str, Any] | None = None,
    ) -> str:
        """Render message dicts; `variables` (tools, chat_template_kwargs) reach the template too."""
        try:
            return str(
                self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=add_generation_prompt, chat_template=template, **(variables or {})
                )
            )
        except (ValueError, TypeError) as exc:
            raise ApiError(
                400,
                f"Cannot build the chat prompt: {exc}. Models without a chat template need "
                "`kvpager serve --chat-template FILE`; or use /v1/completions.",
                param="messages",
            ) from exc

    def _prompt(self, item: str | list[int]) -> Prompt:
        if isinstance(item, str):
            return Prompt(self.tokenizer.encode(item, add_special_tokens=True), item)
        vocab_size = int(self.tokenizer.vocab_size)
        bad = [t for t in item if not 0 <= t < vocab_size]
        if bad:
            raise ApiError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})", param="prompt")
        return Prompt(list(item), None)

    # -- sampling -------------------------------------------------------------------------------
    def max_tokens(self, requested: int | None, num_prompt_tokens: int) -> int:
        """Resolve max_tokens against the context limit (400 with vLLM's wording when it cannot fit)."""
        limit = self.engine.max_model_len
        if num_prompt_tokens == 0:
            raise ApiError(400, "The prompt is empty; send at least one token.", param="prompt")
        if num_prompt_tokens >= limit:
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your request has "
                f"{num_prompt_tokens} input tokens. Please reduce the length of the input messages.",
                param="messages",
            )
        if requested is None:
            return limit - num_prompt_tokens
        if num_prompt_tokens + requested > limit:
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the messages, {requested} in "
                "the completion). Please reduce the length of the messages or completion.",
                param="max_tokens",
            )
        return requested

    def logit_bias(self, req: _SamplingFields) -> dict[int, float] | None:
        """OpenAI's `logit_bias` (token id strings -> bias) as ids; 400 on ids outside the vocabulary."""
        if not req.logit_bias:
            return None
        vocab_size = int(self.engine.engine.model_spec.vocab_size)
        bias: dict[int, float] = {}
        for key, value in req.logit_bias.items():
            try:
                token_id = int(key)
            except ValueError:
                raise ApiError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
            if not 0 <= token_id < vocab_size:
                raise ApiError(
                    400,
                    f"logit_bias token id {token_id} is outside the vocabulary [0, {vocab_size})",
                    param="logit_bias",
                )
            bias[token_id] = value
        return bias

    def sampling_params(
        self,
        req: _SamplingFields,
        max_tokens: int,
        logprobs: int | None,
        *,
        prompt_logprobs: int | None = None,
        structured: StructuredOutputSpec | None = None,
    ) -> SamplingParams:
        """The engine's SamplingParams for a request (400 when the combination is invalid)."""
        try:
            return SamplingParams(
                n=req.n,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=0 if req.top_k is None else req.top_k,
                min_p=0.0 if req.min_p is None else req.min_p,
                seed=req.seed,
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                ignore_eos=req.ignore_eos,
                stop=req.stop,
                stop_token_ids=req.stop_token_ids,
                repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                logprobs=logprobs,
                include_stop_str_in_output=req.include_stop_str_in_output,
                skip_special_tokens=req.skip_special_tokens,
                logit_bias=self.logit_bias(req),
                prompt_logprobs=prompt_logprobs,
                structured=structured,
            )
        except ValueError as exc:
            raise ApiError(400, str(exc)) from exc

    async def compile_grammar(self, spec: StructuredOutputSpec) -> None:
        """Compile (or find cached) the request's grammar on the compiler thread; 400 when it is invalid.

        NOTE: awaited before the request is added, so the engine step never waits on a compilation.
        """
        try:
            await asyncio.wrap_future(self.engine.engine.grammar.compile(spec))
        except ValueError as exc:
            raise ApiError(400, str(exc), param="response_format", code="invalid_grammar") from exc

    # -- engine ---------------------------------------------------------------------------------
    async def start(self, base_id: str, prompts: list[Prompt], params: list[SamplingParams]) -> list[RequestStream]:
        """Add every prompt to the engine; on any failure abort those already added."""
        streams: list[RequestStream] = []
        try:
            if self.prefill is not None:
                prefill = self.prefill
                await asyncio.gather(*(prefill.fetch_into(self.engine, p.token_ids) for p in prompts))
            for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
                streams.append(await self.engine.add_request(prompt.token_ids, p, f"{base_id}-{i}"))
        except BaseException as exc:
            for stream in streams:
                stream.abort()
            raise engine_error(exc) from exc
        return streams

    async def merged(self, streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of all streams as they come, tagged with the prompt index; leaving aborts all."""
        if len(streams) == 1:
            try:
                async for out in streams[0]:
                    self._observe(out)
                    yield 0, out
            finally:
                streams[0].abort()  # closing this generator leaves the inner one suspended
            return
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for out in stream:
                    queue.put_nowait((i, out))
                queue.put_nowait((i, None))
            except Exception as exc:
                queue.put_nowait((i, exc))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(streams)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                self._observe(item)
                yield i, item
        finally:
            for task in tasks:
                task.cancel()
            for stream in streams:
                stream.abort()

    async def collect(self, streams: list[RequestStream], request: Request) -> Finals:
        """Run streams to completion; a client that disconnects first aborts them all."""
        finals = Finals()

        async def run() -> None:
            async for i, out in self.merged(streams):
                finals.update(i, out)

        task = asyncio.create_task(run())
        watcher = asyncio.create_task(_wait_disconnect(request))
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not task.done():
                task.cancel()  # the client left (or we were cancelled): abort at once
                for stream in streams:
                    stream.abort()
                await asyncio.gather(task, return_exceptions=True)
        if task.cancelled():
            raise ApiError(499, "client disconnected")
        exc = task.exception()
        if exc is not None:
            raise engine_error(exc) from exc
        return finals

    def _observe(self, out: RequestOutput) -> None:
        if out.finished:
            self.metrics.observe_finished(out)

    # -- logprobs -------------------------------------------------------------------------------
    def token_text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False))

    def top_logprobs(self, pos: PositionLogprobs) -> list[TopLogprob]:
        return [_top(self.token_text(t), lp) for t, lp in pos.top]


class EngineStreamingResponse(StreamingResponse):
    """An SSE response that aborts its engine requests however the response ends.

    NOTE: if the client leaves before the body generator even starts, closing the generator does
    not run its cleanup; this `finally` does, so the blocks are freed at once in every case.
    """

    def __init__(self, content: AsyncIterator[str], streams: list[RequestStream]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._streams = streams

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for stream in self._streams:
                stream.abort()


def sse(payload: dict[str, Any]) -> str:
    """One Server-Sent Events message carrying a JSON payload."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _top(token: str, logprob: float) -> TopLogprob:
    return TopLogprob(token=token, logprob=max(logprob, -9999.0), bytes=list(token.encode("utf-8")))


def engine_error(exc: BaseException) -> BaseException:
    """Map engine-side failures to HTTP errors (other exceptions pass through unchanged)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, QueueFullError):
        return ApiError(503, str(exc), code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, EngineDeadError):
        return ApiError(503, str(exc), code="engine_dead")
    if isinstance(exc, ValueError):
        return ApiError(400, str(exc))
    return exc


async def _wait_disconnect(request: Request) -> None:
    """Return when the client closes the connection (the body has already been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
