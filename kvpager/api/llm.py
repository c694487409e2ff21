"""LLM: the offline batch API, shaped like vLLM's.

from kvpager import LLM, SamplingParams
llm = LLM(model="path/to/checkpoint", kv_cache_memory=1 << 30)
for out in llm.generate(["Hello"], SamplingParams(max_tokens=32)):
    print(out.outputs[0].text)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from kvpager.core.config import EngineConfig
from kvpager.core.outputs import RequestOutput
from kvpager.core.sampling_params import SamplingParams
from kvpager.engine.engine import Engine

Prompt = str | list[int]


class LLM:
    """Offline inference over a whole batch with continuous batching underneath."""

    def __init__(self, model: str | None = None, **config: Any) -> None:
        self.engine = Engine(EngineConfig(model=model, **config))
        self._next_id = 0

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        `prompts` is a string, a list of token ids, or a list of either. `sampling_params` is one
        SamplingParams for all prompts or one per prompt. Bad input raises ValueError before any
        request is queued.
        """
        batch = _as_batch(prompts)
        params = _params_for(batch, sampling_params)
        ids = [self._new_id() for _ in batch]
        added: list[str] = []
        try:
            for rid, prompt, p in zip(ids, batch, params, strict=True):
                self.engine.add_request(rid, prompt, p)
                added.append(rid)
        except ValueError:
            for rid in added:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]],
        sampling_params: SamplingParams | None = None,
        chat_template: str | None = None,
        use_tqdm: bool = False,
    ) -> RequestOutput:
        """One chat turn rendered with the model's chat template."""
        text = self.engine.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, chat_template=chat_template
        )
        ids = self.engine.tokenizer.encode(text, add_special_tokens=False)
        return self.generate([ids], sampling_params, use_tqdm=use_tqdm)[0]

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, unit="req")
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        finally:
            bar.close()
        return [finished[rid] for rid in ids]

    def _new_id(self) -> str:
        self._next_id += 1
        return f"llm-{self._next_id}"


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    batch = list(prompts)
    if not batch:
        raise ValueError("prompts is empty: pass at least one prompt")
    return batch  # type: ignore[return-value]


def _params_for(
    batch: list[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None
) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams() for _ in batch]
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * len(batch)
    params = list(sampling_params)
    if len(params) != len(batch):
        raise ValueError(f"got {len(params)} sampling_params for {len(batch)} prompts; pass one or one per prompt")
    return params
