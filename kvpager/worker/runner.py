"""ModelRunner: a scheduled batch becomes tensors, the model runs, the sampler picks tokens.

The runner owns the model, the KV cache tensor and its own state per request (tokens, block table,
seeded generator), kept up to date from the scheduler's frozen `SchedulerOutput` alone: new requests
arrive once with their prompt, parameters and block table; each step brings only diffs (new block
ids, preempted and finished ids). It returns sampled token ids and never touches scheduler or
request objects.

Tensor parallelism: every rank runs a runner over its shard of the model and of the KV pool (same
block ids everywhere). Rank 0's (the driver) hands each step to `on_step` first (the engine
broadcasts it with the tokens sampled in the previous step) and samples; the others (followers)
run the same forward and collectives, then learn the sampled tokens from the next message
(`apply_sampled`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvpager.core.hashing import RequestId
from kvpager.core.outputs import PositionLogprobs
from kvpager.core.request import token_ids_between
from kvpager.core.sampling_params import SamplingParams
from kvpager.core.scheduler import NewRequestData, SchedulerOutput
from kvpager.model.attention import AttentionMetadata, allocate_kv_cache, build_attention_metadata
from kvpager.model.llama import CausalLM
from kvpager.model.parallel import TensorParallel
from kvpager.model.precision import fp32_matmul_precision
from kvpager.model.spec import ModelSpec
from kvpager.worker.prompt_logprobs import store_prompt_logprobs
from kvpager.worker.sampler import Sampler, SamplingRow
from kvpager.worker.structured import GrammarCompiler, advance, batch_bitmask


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprobs: PositionLogprobs | None


@dataclass(slots=True)
class _RowState:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None
    stop_token_ids: tuple[int, ...]
    block_ids: list[int]
    matcher: Any = None  # llguidance LLMatcher of a structured-output request
    prompt_logprobs: dict[int, PositionLogprobs] | None = None  # prompt position -> its logprobs
    prompt_logprobs_taken: bool = False

    def token_ids_between(self, start: int, end: int) -> list[int]:
        return token_ids_between(self.prompt_token_ids, self.output_token_ids, start, end)


class ModelRunner:
    """Runs one scheduled step: `execute(scheduler_output) -> {request_id: SampledToken}`."""

    def __init__(
        self,
        model: CausalLM,
        spec: ModelSpec,
        *,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype,
        device: torch.device,
        eos_token_ids: tuple[int, ...],
        fp32_matmul_precision: str = "highest",
        seed: int | None = 0,
        grammar: GrammarCompiler | None = None,
        parallel: TensorParallel | None = None,
        on_step: Callable[[SchedulerOutput, dict[RequestId, int]], None] | None = None,
    ) -> None:
        self.model = model
        self.parallel = parallel
        self.is_driver = parallel is None or parallel.rank == 0
        self.on_step = on_step  # driver under tensor parallelism: broadcast (step, last step's tokens)
        self._unsent: dict[RequestId, int] = {}  # tokens sampled since the last `on_step`
        self.spec = spec
        self.block_size = block_size
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.fp32_matmul_precision = fp32_matmul_precision
        # kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        # NOTE: model.spec, not spec: under tensor parallelism it holds this rank's KV heads only
        self.kv_cache = allocate_kv_cache(model.spec, num_blocks, block_size, kv_dtype, device)
        # unseeded requests draw from one generator seeded by the engine's --seed (vLLM's meaning)
        self.sampler = Sampler(seed)
        self.grammar = grammar
        self._rows: dict[str, _RowState] = {}

    @property
    def num_requests(self) -> int:
        """Requests whose state the runner holds (sent and not finished yet)."""
        return len(self._rows)

    def _update_states(self, out: SchedulerOutput) -> None:
        """Apply a step's diffs, in the order `SchedulerOutput` documents."""
        for request_id in out.finished_ids:
            self._rows.pop(request_id, None)
        for request_id in out.preempted_ids:
            self._rows[request_id].block_ids.clear()  # NOTE: tokens and generator state are kept
        for new in out.new_requests:
            self._add_row(new)
        for s in out.scheduled:
            if s.new_block_ids:
                self._rows[s.request_id].block_ids.extend(s.new_block_ids)

    def _add_row(self, new: NewRequestData) -> None:
        params: SamplingParams = new.sampling_params
        generator = None
        if params.seed is not None and self.is_driver:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        stop_ids = tuple(params.stop_token_ids or ())
        row = _RowState(params, list(new.prompt_token_ids), [], generator, stop_ids, list(new.block_ids))
        if params.structured is not None and self.is_driver:
            # NOTE: the engine compiled (and so validated) the grammar before admitting the request
            assert self.grammar is not None, "structured output needs a grammar compiler (llguidance)"
            row.matcher = self.grammar.matcher(params.structured)
        if params.prompt_logprobs is not None:
            row.prompt_logprobs = {}
        self._rows[new.request_id] = row

    def apply_sampled(self, sampled: dict[RequestId, int]) -> None:
        """Follower: append the tokens the driver sampled (the driver's runner did so in `_sample`).

        NOTE: the driver's engine takes a row's prompt logprobs when its first token is sampled; a
        follower marks them taken then too, so both compute prompt logits for the same rows.
        """
        for request_id, token_id in sampled.items():
            row = self._rows.get(request_id)
            if row is not None:
                row.output_token_ids.append(token_id)
                row.prompt_logprobs_taken = row.prompt_logprobs is not None or row.prompt_logprobs_taken

    def take_prompt_logprobs(self, request_id: str) -> list[PositionLogprobs | None] | None:
        """The prompt logprobs of a request whose prefill is complete, once (None first: no context)."""
        row = self._rows.get(request_id)
        if row is None or row.prompt_logprobs is None or row.prompt_logprobs_taken:
            return None
        row.prompt_logprobs_taken = True
        got = row.prompt_logprobs
        return [None] + [got.get(p) for p in range(1, len(row.prompt_token_ids))]

    def read_block(self, block_id: int) -> torch.Tensor:
        """Block `block_id`'s K/V: a view [num_layers, 2, block_size, num_kv_heads, head_dim].

        NOTE: a view of the pool: encode or copy it before the block is reused.
        """
        self._check_whole_pool()
        return self.read_shard(block_id)

    def write_block(self, block_id: int, block: torch.Tensor) -> None:
        """Copy `block` ([num_layers, 2, block_size, num_kv_heads, head_dim], any device) into the pool."""
        self._check_whole_pool()
        self.write_shard(block_id, block)

    def read_shard(self, block_id: int) -> torch.Tensor:
        """This rank's part of block `block_id` (under tensor parallelism its KV heads only; without it
        the whole block): a view [num_layers, 2, block_size, kv heads here, head_dim]."""
        return self.kv_cache[:, :, block_id]

    def write_shard(self, block_id: int, block: torch.Tensor) -> None:
        """Copy this rank's part of a block (`read_shard`'s shape) into the pool."""
        self.kv_cache[:, :, block_id].copy_(block)

    def _check_whole_pool(self) -> None:
        if self.parallel is not None:
            raise ValueError(
                "a rank's runner cannot read or write whole KV blocks under tensor parallelism (it holds a "
                "shard of each): whole blocks go through kvpager.kvstore.sharded.ShardedBlockIO"
            )

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[RequestId, SampledToken]:
        """Apply the step's diffs to the runner's state, then run its batch (if any) and sample."""
        if self.on_step is not None:
            self.on_step(out, self._unsent)
            self._unsent = {}
        self._update_states(out)
        if not out.scheduled:
            return {}
        with fp32_matmul_precision(self.fp32_matmul_precision):
            return self._execute(out)

    def _execute(self, out: SchedulerOutput) -> dict[RequestId, SampledToken]:
        scheduled = out.scheduled
        input_ids, positions, md = self._prepare_inputs(out)
        hidden = self.model(input_ids, positions, self.kv_cache, md)
        store_prompt_logprobs(out.scheduled, self._rows, hidden, self.model.compute_logits)
        # NOTE: logits only for sequences whose step reaches their last known token.
        ends: list[int] = []
        sample_ids: list[RequestId] = []
        offset = 0
        for s in scheduled:
            offset += s.num_tokens
            if s.needs_sample:
                ends.append(offset - 1)
                sample_ids.append(s.request_id)
        if not sample_ids:
            return {}
        index = torch.tensor(ends, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, index))  # [S, vocab] fp32
        if not self.is_driver:
            return {}  # NOTE: rank 0 samples; the tokens arrive with the next step
        return self._sample(sample_ids, logits)

    def _prepare_inputs(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        token_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        block_tables: list[list[int]] = []
        for s in out.scheduled:
            row, n, start = self._rows[s.request_id], s.num_tokens, s.start_position
            token_ids.extend(row.token_ids_between(start, start + n))
            positions.extend(range(start, start + n))
            query_lens.append(n)
            seq_lens.append(start + n)
            block_tables.append(row.block_ids)
        md = build_attention_metadata(
            query_lens, seq_lens, block_tables, self.block_size, self.device, sliding_window=self.spec.sliding_window
        )
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        return ids, pos, md

    def _sample(self, request_ids: list[RequestId], logits: torch.Tensor) -> dict[RequestId, SampledToken]:
        rows = [self._sampling_row(rid) for rid in request_ids]
        bitmask, guided = batch_bitmask([self._rows[rid].matcher for rid in request_ids], logits.shape[1])
        result = self.sampler.sample(logits, rows, bitmask, guided)
        token_ids = result.token_ids.tolist()
        sampled: dict[RequestId, SampledToken] = {}
        for i, rid in enumerate(request_ids):
            lp = result.logprobs[i] if result.logprobs is not None else None
            row = self._rows[rid]
            row.output_token_ids.append(token_ids[i])
            if row.matcher is not None:
                advance(row.matcher, token_ids[i])
            sampled[rid] = SampledToken(token_ids[i], lp)
            if self.on_step is not None:
                self._unsent[rid] = token_ids[i]
        return sampled

    def _sampling_row(self, request_id: str) -> SamplingRow:
        row = self._rows[request_id]
        return SamplingRow(
            params=row.params,
            prompt_token_ids=row.prompt_token_ids,
            output_token_ids=row.output_token_ids,
            generator=row.generator,
            eos_token_ids=self.eos_token_ids,
        )
