"""The tensor-parallel step message: a `SchedulerOutput` plus the tokens sampled last step, as JSON bytes.

Rank 0 runs the scheduler and samples; every other rank runs the same forward on its shard. Each
step rank 0 sends them one `StepMessage` (docs/scale-out.md): the plain-data `SchedulerOutput` and
the tokens it sampled in the previous step (so each rank's runner keeps every request's tokens, as
rank 0's does), and the KV tier operations rank 0 decided (`TierOps`: blocks whose shards each rank
copies to its tiers or publishes to the shared store, prefix loads each rank fills from them, KV pack
blocks it fills or gathers to rank 0; kvpager/kvstore/sharded.py). JSON,
never pickle: a message can only ever become these dataclasses. Torch-free.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from kvpager.core.hashing import BlockHash, RequestId
from kvpager.core.sampling_params import SamplingParams, StructuredOutputSpec
from kvpager.core.scheduler import NewRequestData, ScheduledRequest, SchedulerOutput

OP_STEP = "step"
OP_STOP = "stop"


@dataclass(frozen=True)
class TierOps:
    """The KV tier work of one step, run by every rank on its own shards before the step's forward."""

    offloads: tuple[tuple[int, BlockHash], ...] = ()  # (block id, hash): copy the evicted block out
    publishes: tuple[tuple[int, BlockHash], ...] = ()  # (block id, hash): write its shard to the shared store
    loads: tuple[tuple[int, tuple[tuple[BlockHash, int], ...]], ...] = ()  # (job id, ((hash, block id), ...))
    fills: tuple[int, ...] = ()  # block ids whose whole K/V rank 0 broadcasts next (a KV pack): each keeps its heads
    gathers: tuple[int, ...] = ()  # block ids whose shards every rank sends to rank 0 (a KV pack export)
    flush: bool = False  # then write the host tier's blocks to the disk tier (at shutdown)

    @property
    def is_empty(self) -> bool:
        return not (self.offloads or self.publishes or self.loads or self.fills or self.gathers or self.flush)


@dataclass(frozen=True)
class StepMessage:
    """One broadcast from rank 0: run `output` (op "step") or exit (op "stop")."""

    op: str
    output: SchedulerOutput | None = None
    sampled: dict[RequestId, int] = field(default_factory=dict)  # last step's tokens, request id -> token
    tier_ops: TierOps = field(default_factory=TierOps)


def encode_step(message: StepMessage) -> bytes:
    """UTF-8 JSON of the message."""
    doc: dict[str, Any] = {"op": message.op, "sampled": [[rid, tok] for rid, tok in message.sampled.items()]}
    if message.output is not None:
        doc["output"] = _encode_output(message.output)
    if not message.tier_ops.is_empty:
        doc["tier"] = _encode_tier_ops(message.tier_ops)
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode("utf-8")


def decode_step(payload: bytes) -> StepMessage:
    """The message `encode_step` wrote; ValueError on anything else."""
    try:
        doc = json.loads(payload.decode("utf-8"))
        op = doc["op"]
        if op not in (OP_STEP, OP_STOP):
            raise ValueError(f"unknown op {op!r}")
        sampled = {RequestId(str(rid)): int(tok) for rid, tok in doc["sampled"]}
        output = _decode_output(doc["output"]) if "output" in doc else None
        tier_ops = _decode_tier_ops(doc["tier"]) if "tier" in doc else TierOps()
    except (KeyError, TypeError, ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"malformed tensor-parallel step message: {exc}") from exc
    return StepMessage(op, output, sampled, tier_ops)


def _encode_tier_ops(ops: TierOps) -> dict[str, Any]:
    return {
        "offloads": [[block_id, block_hash.hex()] for block_id, block_hash in ops.offloads],
        "publishes": [[block_id, block_hash.hex()] for block_id, block_hash in ops.publishes],
        "loads": [[job_id, [[h.hex(), block_id] for h, block_id in blocks]] for job_id, blocks in ops.loads],
        "fills": list(ops.fills),
        "gathers": list(ops.gathers),
        "flush": ops.flush,
    }


def _decode_tier_ops(doc: dict[str, Any]) -> TierOps:
    offloads = tuple((int(block_id), BlockHash(bytes.fromhex(h))) for block_id, h in doc["offloads"])
    publishes = tuple((int(block_id), BlockHash(bytes.fromhex(h))) for block_id, h in doc["publishes"])
    loads = tuple(
        (int(job_id), tuple((BlockHash(bytes.fromhex(h)), int(block_id)) for h, block_id in blocks))
        for job_id, blocks in doc["loads"]
    )
    fills = tuple(int(block_id) for block_id in doc["fills"])
    gathers = tuple(int(block_id) for block_id in doc["gathers"])
    return TierOps(offloads, publishes, loads, fills, gathers, bool(doc["flush"]))


def _encode_output(out: SchedulerOutput) -> dict[str, Any]:
    return {
        "scheduled": [
            [s.request_id, s.num_tokens, s.start_position, list(s.new_block_ids), s.needs_sample] for s in out.scheduled
        ],
        "new": [
            [n.request_id, list(n.prompt_token_ids), _encode_params(n.sampling_params), list(n.block_ids)]
            for n in out.new_requests
        ],
        "preempted": list(out.preempted_ids),
        "finished": list(out.finished_ids),
    }


def _decode_output(doc: dict[str, Any]) -> SchedulerOutput:
    scheduled = tuple(
        ScheduledRequest(RequestId(str(rid)), int(n), int(start), tuple(int(b) for b in blocks), bool(sample))
        for rid, n, start, blocks, sample in doc["scheduled"]
    )
    new = tuple(
        NewRequestData(
            RequestId(str(rid)), tuple(int(t) for t in prompt), _decode_params(params), tuple(int(b) for b in blocks)
        )
        for rid, prompt, params, blocks in doc["new"]
    )
    preempted = tuple(RequestId(str(r)) for r in doc["preempted"])
    finished = tuple(RequestId(str(r)) for r in doc["finished"])
    return SchedulerOutput(scheduled, new, preempted, finished)


def _encode_params(params: SamplingParams) -> dict[str, Any]:
    doc = asdict(params)
    if params.logit_bias is not None:
        doc["logit_bias"] = [[k, v] for k, v in params.logit_bias.items()]  # NOTE: JSON keys are strings
    return doc


def _decode_params(doc: dict[str, Any]) -> SamplingParams:
    fields = dict(doc)
    if fields.get("logit_bias") is not None:
        fields["logit_bias"] = {int(k): float(v) for k, v in fields["logit_bias"]}
    if fields.get("structured") is not None:
        fields["structured"] = StructuredOutputSpec(**fields["structured"])
    return SamplingParams(**fields)
