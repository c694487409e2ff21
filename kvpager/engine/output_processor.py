"""Turns sampled tokens into text and finish decisions, and groups n samples under their request.

Per sequence it runs the incremental detokenizer and the stop checks (EOS, stop token ids, stop
strings, max_tokens, max_model_len). It decides *that* a sequence finishes; the engine tells the
scheduler. Torch-free.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvpager.core.outputs import CompletionOutput, PositionLogprobs, RequestMetrics, RequestOutput
from kvpager.core.sampling_params import SamplingParams
from kvpager.text.detokenizer import IncrementalDetokenizer, StopChecker
from kvpager.text.tokenizer import Tokenizer


@dataclass(slots=True)
class SequenceState:
    """One generated sequence (one of a request's n samples)."""

    seq_id: str
    parent_id: str
    index: int
    params: SamplingParams
    max_tokens: int
    detokenizer: IncrementalDetokenizer
    stop_checker: StopChecker
    output: CompletionOutput


@dataclass(slots=True)
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    metrics: RequestMetrics
    seq_ids: list[str]
    num_cached_tokens: int = 0
    num_finished: int = 0
    changed: set[int] = field(default_factory=set)
    prompt_logprobs: list[PositionLogprobs | None] | None = None


class OutputProcessor:
    """Keeps the text side of every live request."""

    def __init__(self, tokenizer: Tokenizer, eos_token_ids: tuple[int, ...], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.parents: dict[str, ParentState] = {}
        self.seqs: dict[str, SequenceState] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        seq_ids: list[str],
        arrival_time: float,
    ) -> None:
        parent = ParentState(request_id, prompt, prompt_token_ids, RequestMetrics(arrival_time), list(seq_ids))
        self.parents[request_id] = parent
        stops = [params.stop] if isinstance(params.stop, str) else list(params.stop or [])
        for index, seq_id in enumerate(seq_ids):
            self.seqs[seq_id] = SequenceState(
                seq_id=seq_id,
                parent_id=request_id,
                index=index,
                params=params,
                max_tokens=max_tokens,
                detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens),
                stop_checker=StopChecker(stops, params.include_stop_str_in_output),
                output=CompletionOutput(index=index, logprobs=[] if params.logprobs is not None else None),
            )

    def process_token(
        self, seq_id: str, token_id: int, logprobs: PositionLogprobs | None, num_cached_tokens: int, now: float
    ) -> str | None:
        """Record one sampled token. Returns the finish reason when the sequence ends."""
        seq = self.seqs[seq_id]
        parent = self.parents[seq.parent_id]
        parent.num_cached_tokens = max(parent.num_cached_tokens, num_cached_tokens)
        metrics = parent.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        elif metrics.last_token_time is not None and seq.index == 0:
            metrics.inter_token_latencies.append(now - metrics.last_token_time)
        metrics.last_token_time = now
        out = seq.output
        out.token_ids.append(token_id)
        out.delta_token_ids.append(token_id)
        if logprobs is not None and out.logprobs is not None:
            out.logprobs.append(logprobs)
            if out.delta_logprobs is None:
                out.delta_logprobs = []
            out.delta_logprobs.append(logprobs)
        parent.changed.add(seq.index)
        reason = self._check_token_stop(seq, token_id)
        # NOTE: a stopping EOS / stop token id is kept in token_ids but never rendered as text.
        new_text = "" if reason is not None else seq.detokenizer.add(token_id)
        emit, stopped, matched = seq.stop_checker.feed(new_text)
        self._emit(seq, emit)
        if stopped:
            out.stop_reason = matched
            return self._finish(seq, "stop")
        if reason is None:
            reason = self._check_length(seq, len(parent.prompt_token_ids))
        if reason is not None:
            self._emit(seq, seq.stop_checker.flush())
            return self._finish(seq, reason)
        return None

    def set_prompt_logprobs(self, seq_id: str, prompt_logprobs: list[PositionLogprobs | None]) -> None:
        """Attach the prompt's logprobs (computed by sample 0) to its request's outputs."""
        parent = self.parents[self.seqs[seq_id].parent_id]
        parent.prompt_logprobs = prompt_logprobs

    def _check_token_stop(self, seq: SequenceState, token_id: int) -> str | None:
        params = seq.params
        if len(seq.output.token_ids) < params.min_tokens:
            return None
        if params.stop_token_ids and token_id in params.stop_token_ids:
            seq.output.stop_reason = token_id
            return "stop"
        if not params.ignore_eos and token_id in self.eos_token_ids:
            return "stop"
        return None

    def _check_length(self, seq: SequenceState, num_prompt_tokens: int) -> str | None:
        num_output = len(seq.output.token_ids)
        if num_output >= seq.max_tokens or num_prompt_tokens + num_output >= self.max_model_len:
            return "length"
        return None

    def _emit(self, seq: SequenceState, text: str) -> None:
        if text:
            seq.output.text += text
            seq.output.delta_text += text

    def _finish(self, seq: SequenceState, reason: str) -> str:
        seq.output.finish_reason = reason
        parent = self.parents[seq.parent_id]
        parent.num_finished += 1
        parent.changed.add(seq.index)
        return reason

    def abort(self, request_id: str) -> RequestOutput | None:
        """Mark every unfinished sequence of a request aborted; returns its final output."""
        parent = self.parents.get(request_id)
        if parent is None:
            return None
        for seq_id in parent.seq_ids:
            seq = self.seqs[seq_id]
            if seq.output.finish_reason is None:
                self._finish(seq, "abort")
        return self.collect(request_id, time.monotonic())

    def collect(self, request_id: str, now: float) -> RequestOutput:
        """Build the output for a request that changed this step; resets its deltas."""
        parent = self.parents[request_id]
        finished = parent.num_finished == len(parent.seq_ids)
        outputs: list[CompletionOutput] = []
        # NOTE: a finished request reports every sample, so its last output is complete on its own.
        indices = range(len(parent.seq_ids)) if finished else sorted(parent.changed)
        for index in indices:
            out = self.seqs[parent.seq_ids[index]].output
            outputs.append(_snapshot(out))
            out.delta_text, out.delta_token_ids, out.delta_logprobs = "", [], None
        parent.changed.clear()
        if finished:
            parent.metrics.finished_time = now
            for seq_id in parent.seq_ids:
                del self.seqs[seq_id]
            del self.parents[request_id]
        return RequestOutput(
            request_id=request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=parent.num_cached_tokens,
            metrics=parent.metrics,
            prompt_logprobs=parent.prompt_logprobs,
        )

    def parent_of(self, seq_id: str) -> str:
        return self.seqs[seq_id].parent_id

    def seq_ids_of(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return list(parent.seq_ids) if parent is not None else []


def _snapshot(out: CompletionOutput) -> CompletionOutput:
    """A copy the caller may keep while the engine goes on appending."""
    return CompletionOutput(
        index=out.index,
        text=out.text,
        token_ids=list(out.token_ids),
        finish_reason=out.finish_reason,
        stop_reason=out.stop_reason,
        logprobs=list(out.logprobs) if out.logprobs is not None else None,
        delta_text=out.delta_text,
        delta_token_ids=list(out.delta_token_ids),
        delta_logprobs=list(out.delta_logprobs) if out.delta_logprobs is not None else None,
    )
