"""Engine: the synchronous step loop that ties scheduler, runner and output processing together.

`add_request` validates and queues; each `step()` schedules one batch, runs it, samples, and returns
incremental outputs for the requests that moved. Not thread-safe: `AsyncEngine` drives it from one
thread.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, replace

from kvpager.core.config import EngineConfig
from kvpager.core.hashing import RequestId
from kvpager.core.kv_cache_manager import KVCacheManager
from kvpager.core.outputs import RequestOutput
from kvpager.core.request import Request, RequestStatus
from kvpager.core.sampling_params import SamplingParams
from kvpager.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvpager.engine.admission import AdmissionContext, admit, check_prompt_ids, tokenize
from kvpager.engine.executor import TensorParallelExecutor, build_store, sharded_block_io, share_fingerprint
from kvpager.engine.kv_transfer import KVPoolBusyError, KVTransfer
from kvpager.engine.loading import LoadedModel, build_runner, load, log_pool, model_spec_of, resolve_device
from kvpager.engine.output_processor import OutputProcessor
from kvpager.kvstore.offload import KVTierStats, TieredBlockStore
from kvpager.kvstore.pack import Pack, PackExpectation, PackModel
from kvpager.kvstore.publisher import RemotePublisher
from kvpager.kvstore.sharded import ShardedTierStore
from kvpager.model.parallel import TensorParallel
from kvpager.worker.structured import GrammarCompiler

logger = logging.getLogger("kvpager")

LOAD_WAIT_S = 0.005  # how long an idle step waits for a prefix load from a KV tier

FINISH_STATUS = {
    "stop": RequestStatus.FINISHED_STOPPED,
    "length": RequestStatus.FINISHED_LENGTH,
    "abort": RequestStatus.FINISHED_ABORTED,
}


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # owned blocks / all blocks
    num_owned_blocks: int
    num_blocks: int
    num_cached_blocks: int
    prefix_cache_queries: int  # tokens looked up
    prefix_cache_hits: int  # tokens found
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int


class Engine:
    """Paged-KV continuous-batching engine. See docs/internals.md for the contract."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        # NOTE: tensor parallelism: the workers start and join before anything loads (each loads its shard)
        self.executor = self._start_executor(config, loaded)
        try:
            self.loaded = loaded if loaded is not None else load(config, self._parallel)
        except BaseException:
            if self.executor is not None:
                self.executor.abort()
            raise
        lm = self.loaded
        if self.executor is not None:
            share_fingerprint(self.executor.parallel.store, lm.fingerprint)
        self.config = lm.config if lm.config is not None else config  # NOTE: dtype resolved ("auto")
        self.tokenizer = lm.tokenizer
        self.model_spec = lm.spec
        self.pool = lm.pool
        self.max_model_len = lm.max_model_len
        self.model_name = str(config.model) if config.model is not None else "kvpager-demo"
        self.eos_token_ids = tuple(self.tokenizer.eos_token_ids)
        # NOTE: thread-safe; the server compiles a request's grammar here before adding it.
        self.grammar = GrammarCompiler(self.tokenizer.backend_json(), lm.spec.vocab_size, self.eos_token_ids)
        self.runner = build_runner(
            lm,
            config,
            self._parallel,
            eos_token_ids=self.eos_token_ids,
            grammar=self.grammar,
            on_step=self._broadcast_step if self.executor is not None else None,
        )
        self.kv_store = build_store(config, lm.fingerprint, self.runner, lm.device, self.executor)
        self.kv_manager = KVCacheManager(
            block_size=config.block_size,
            num_blocks=lm.pool.num_blocks,
            enable_caching=config.enable_prefix_caching,
            hash_seed=lm.fingerprint,
            store=self.kv_store,
        )
        # NOTE: with a shared store, each block is written there as soon as its forward ran (not only
        # on eviction), so other replicas hit it while it is still on this device; the writes run on
        # the publisher's thread, never in a step.
        # Under tensor parallelism the blocks go to every rank in a tier-only message (each writes its shard).
        self.kv_publisher = None
        remote = self.kv_store.tiers.remote if self.kv_store is not None else None
        if isinstance(self.kv_store, ShardedTierStore) and remote is not None:
            self.kv_publisher = RemotePublisher(remote, self.kv_manager.block_pool, None, publish=self.kv_store.publish)
        elif remote is not None:
            self.kv_publisher = RemotePublisher(remote, self.kv_manager.block_pool, self.runner)
        sched_config = SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=lm.max_model_len,
            block_size=config.block_size,
        )
        self.scheduler = Scheduler(sched_config, self.kv_manager)
        tiered = self.kv_store if isinstance(self.kv_store, TieredBlockStore) else None
        # NOTE: packs hold whole blocks; under tensor parallelism they are gathered from / spread over the ranks
        block_io = sharded_block_io(self.executor, self.runner, self.kv_store) if self.executor else self.runner
        self.kv_transfer = KVTransfer(self.kv_manager, block_io, self.kv_expectation(), tiered)
        for path in config.kv_packs:
            num_blocks = self.kv_transfer.load_pack(path)
            logger.info("KV pack %s: %d blocks pinned in the prefix cache", path, num_blocks)
        self._is_shut_down = False
        self._changed: dict[str, None] = {}  # parents with output not reported yet (see `step`)
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids, lm.max_model_len)
        self._admission = AdmissionContext(
            vocab_size=lm.spec.vocab_size,
            max_model_len=lm.max_model_len,
            limits=config.request_limits,
            encode=self.tokenizer.encode,
            parent_in_use=lambda rid: rid in self.outputs.parents,
            sequence_in_use=lambda sid: sid in self.scheduler.requests or sid in self.outputs.seqs,
        )
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        log_pool(lm.pool, lm.max_model_len)
        ops = lm.model.ops
        kernels = getattr(ops, "kernels", None)
        logger.info("model math: %s ops%s", ops.name, f" (C++ kernels {kernels.path})" if kernels is not None else "")

    @staticmethod
    def _start_executor(config: EngineConfig, loaded: LoadedModel | None) -> TensorParallelExecutor | None:
        if config.tensor_parallel_size == 1:
            return None
        if loaded is not None:
            raise ValueError(
                "a preloaded model cannot be used with tensor_parallel_size > 1 (each rank loads its shard)"
            )
        return TensorParallelExecutor(config, model_spec_of(config), resolve_device(config.device))

    def _broadcast_step(self, out: SchedulerOutput, sampled: dict[RequestId, int]) -> None:
        """The runner's `on_step` under tensor parallelism (with the tier work rank 0's store queued)."""
        assert self.executor is not None
        self.executor.broadcast_step(
            out, sampled, self.kv_store if isinstance(self.kv_store, ShardedTierStore) else None
        )

    @property
    def _parallel(self) -> TensorParallel | None:
        return self.executor.parallel if self.executor is not None else None

    @property
    def dead_reason(self) -> str | None:
        """Why the engine cannot step any more (a tensor-parallel worker is gone), or None."""
        return self.executor.dead_reason if self.executor is not None else None

    # ---- requests -------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request. Raises ValueError naming the problem; the engine is unchanged then.

        Every check runs first (`admission.admit`, which changes nothing); should queueing still
        fail part-way, what was queued is undone before the error propagates.
        """
        adm = admit(self._admission, request_id, prompt, params, arrival_time)
        if params.structured is not None:
            self._compile_grammar(params)
        queued: list[str] = []
        try:
            for req in adm.requests:
                queued.append(req.request_id)
                self.scheduler.add_request(req)
            self.outputs.add_request(
                request_id, adm.prompt_text, adm.prompt_ids, adm.params, adm.max_tokens, adm.seq_ids, adm.arrival_time
            )
        except BaseException:
            self._undo_admission(request_id, queued)
            raise
        self._prompt_tokens_total += len(adm.prompt_ids)

    def _undo_admission(self, request_id: str, seq_ids: list[str]) -> None:
        for seq_id in seq_ids:
            self.scheduler.abort_request(RequestId(seq_id))  # NOTE: the runner meets requests only in a step
        self.outputs.discard(request_id, seq_ids)

    def _compile_grammar(self, params: SamplingParams) -> None:
        """Compile (or find cached) a structured-output grammar; ValueError when it is invalid.

        NOTE: before any state changes, so the runner's matcher for it never fails mid-step.
        """
        grammar = self.runner.grammar
        if grammar is None:
            raise ValueError("structured output needs a grammar compiler (pip install llguidance)")
        assert params.structured is not None
        grammar.compile(params.structured).result()

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks. Returns its final output, or None if unknown."""
        for seq_id in self.outputs.seq_ids_of(request_id):
            self.scheduler.abort_request(RequestId(seq_id))
        self._changed.pop(request_id, None)  # NOTE: its final output is returned here instead
        return self.outputs.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        """Requests to serve, or an aborted request's tier load whose blocks a later step frees."""
        return bool(self.outputs.parents) or self.scheduler.has_unfinished()

    # ---- the loop -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; return the outputs of requests that produced tokens.

        With nothing to run while a prefix loads from a KV tier, it waits briefly for the load.
        """
        if not self._run_step() and self.kv_manager.has_pending_loads():
            self.kv_manager.wait_for_loads(LOAD_WAIT_S)
        now = time.monotonic()
        changed, self._changed = self._changed, {}
        return [self.outputs.collect(parent_id, now) for parent_id in changed]

    def _run_step(self) -> bool:
        """Schedule and run one batch; the requests that moved wait in `_changed` for `step()` to
        report them. Returns whether anything ran."""
        sched_out = self.scheduler.schedule()
        if self.kv_store is not None:
            self.kv_store.wait_for_copies()  # NOTE: blocks evicted by schedule() are read before reuse
        try:
            sampled = self.runner.execute(sched_out)  # NOTE: also when empty: it carries finished ids
        except Exception as exc:
            if self.executor is None:
                raise
            raise self.executor.failure(exc) from exc
        if self.kv_publisher is not None:
            self.kv_publisher.flush()
        if sched_out.is_empty:
            return False
        now = time.monotonic()
        self.scheduler.update_from_output(sched_out, {rid: s.token_id for rid, s in sampled.items()})
        for seq_id, s in sampled.items():
            request = self.scheduler.requests[seq_id]
            if request.sampling_params.prompt_logprobs is not None:
                prompt_lp = self.runner.take_prompt_logprobs(seq_id)
                if prompt_lp is not None:
                    self.outputs.set_prompt_logprobs(seq_id, prompt_lp)
            reason = self.outputs.process_token(seq_id, s.token_id, s.logprobs, request.num_cached_tokens, now)
            self._generation_tokens_total += 1
            if reason is not None:
                self.scheduler.finish_request(seq_id, FINISH_STATUS[reason])
            self._changed[self.outputs.parent_of(seq_id)] = None
        return True

    def stats(self) -> EngineStats:
        pool = self.kv_manager.block_pool
        num_blocks = self.pool.num_blocks
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=pool.num_owned_blocks / num_blocks,
            num_owned_blocks=pool.num_owned_blocks,
            num_blocks=num_blocks,
            num_cached_blocks=pool.num_cached_blocks,
            prefix_cache_queries=pool.queries,
            prefix_cache_hits=pool.hits,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
        )

    # ---- KV tiers, packs and transfer --------------------------------------------------------
    def kv_expectation(self) -> PackExpectation:
        """What a KV pack or payload must match to be loaded here (model facts + fingerprint)."""
        lm, spec = self.loaded, self.model_spec
        facts = PackModel(
            architecture=spec.architecture,
            dtype=self.config.resolved_kv_cache_dtype,
            block_size=self.config.block_size,
            num_layers=spec.num_layers,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            tokenizer_digest=self.tokenizer.tokenizer_digest(),
            weights_digest=lm.weights_digest,
        )
        return PackExpectation(model_fingerprint=lm.fingerprint.hex(), model=facts, max_tokens=self.max_model_len)

    def export_kv(self, prompt: str | list[int], codec: str = "lossless") -> bytes:
        """KV pack bytes of the prompt's full blocks, prefilling those not cached (ValueError on bad input).

        Call between steps (on the engine thread). The blocks not cached are computed by a
        prefill-only request through the scheduler, so running requests keep stepping meanwhile
        (their outputs are reported by the next `step()`).
        """
        _, prompt_ids = self._tokenize(prompt)
        self._validate_prompt(prompt_ids)
        num_full = self.kv_transfer.check_exportable(prompt_ids)
        request = self._prefill_only(prompt_ids[: num_full * self.config.block_size])
        try:
            block_ids = self.kv_manager.block_ids(request.request_id)[:num_full]
            return self.kv_transfer.export(prompt_ids, block_ids, codec)
        finally:
            self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)

    def _prefill_only(self, token_ids: list[int]) -> Request:
        """Run a prefill-only request through the scheduler until its prompt K/V is complete.

        Returns it PREFILLED, still holding its blocks; the caller finishes it.
        """
        request_id = RequestId(f"kv-export-{uuid.uuid4().hex}")
        request = Request(request_id, token_ids, SamplingParams(max_tokens=1), prefill_only=True)
        self.scheduler.add_request(request)  # ValueError when the pool can never hold it
        while request.status is not RequestStatus.PREFILLED:
            if self._run_step():
                continue
            if request.status is RequestStatus.PREFILLED:
                break
            if not self.scheduler.num_loading:
                self.scheduler.abort_request(request_id)
                raise KVPoolBusyError(
                    f"not enough free KV blocks to prefill {len(token_ids)} tokens for export; "
                    "retry when the engine is less busy or give the KV pool more memory"
                )
            self.kv_manager.wait_for_loads(LOAD_WAIT_S)
        return request

    def import_kv(self, payload: bytes, max_bytes: int | None = None) -> int:
        """Load a KV payload (from `export_kv` or a pack file) into the prefix cache; returns blocks imported.

        ValueError naming the problem on a payload over `max_bytes`, a corrupted one, or one made for
        another model (fingerprint, dtype, block size, tokenizer, ...). Call between steps.
        """
        return self.kv_transfer.import_payload(payload, max_bytes)

    def decode_kv(self, payload: bytes, max_bytes: int | None = None) -> Pack:
        """The checks and decoding of `import_kv` without touching engine state: safe on any thread,
        so a server decodes off the engine thread and inserts with `insert_kv` between steps."""
        return self.kv_transfer.decode_payload(payload, max_bytes)

    def insert_kv(self, pack: Pack, num_bytes: int) -> int:
        """Insert a pack from `decode_kv` into the prefix cache (call between steps)."""
        return self.kv_transfer.insert_payload(pack, num_bytes)

    def kernel_fallbacks(self) -> dict[str, dict[str, int]]:
        """Calls of each CPU kernel op that ran in torch instead, by reason ({op: {reason: calls}})."""
        fallbacks: dict[str, dict[str, int]] = self.runner.model.ops.kernel_stats()["fallbacks"]
        return fallbacks

    def kv_tier_stats(self) -> KVTierStats:
        """Per-tier hits, misses, bytes held, evictions, load/save times and bytes moved."""
        evictions = self.kv_manager.block_pool.evictions
        base = self.kv_store.stats(evictions) if self.kv_store is not None else KVTierStats(None, None, evictions)
        transfer = self.kv_transfer
        return replace(
            base,
            exported=replace(transfer.exported),
            imported=replace(transfer.imported),
            pinned_blocks=len(transfer.pinned_block_ids),
        )

    def shutdown(self) -> None:
        """Persist the prefix cache: device-cached blocks go to the tiers, the host tier is flushed to disk.

        Idempotent. Requests still running are left as they are (abort them first to free blocks).
        """
        if self._is_shut_down:
            return
        self._is_shut_down = True
        self.grammar.shutdown()
        if self.kv_publisher is not None:
            self.kv_publisher.close()
        written = 0
        if self.kv_store is not None and self.dead_reason is None:  # NOTE: under TP every rank writes its shards
            written = self.kv_store.persist(self.kv_manager.block_pool.cached_blocks())
        if self.executor is not None:
            self.executor.shutdown()
        if self.kv_store is None:
            return
        self.kv_store.close()
        logger.info("KV tiers: %d blocks flushed to disk at shutdown", written)

    # ---- helpers --------------------------------------------------------------------------
    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        return tokenize(self._admission, prompt)

    def _validate_prompt(self, prompt_ids: list[int]) -> None:
        check_prompt_ids(prompt_ids, self.model_spec.vocab_size, self.max_model_len)
