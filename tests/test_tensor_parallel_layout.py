"""Tensor parallelism without processes: the layout rule, the step message, the config and the planner."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from kvpager.cli.plan import main as plan_main
from kvpager.core.config import EngineConfig
from kvpager.core.hashing import BlockHash, RequestId
from kvpager.core.sampling_params import SamplingParams, StructuredOutputSpec
from kvpager.core.scheduler import NewRequestData, ScheduledRequest, SchedulerOutput
from kvpager.core.sizing import pool_size
from kvpager.core.step_codec import OP_STEP, OP_STOP, StepMessage, TierOps, decode_step, encode_step
from kvpager.core.tensor_parallel import tensor_parallel_layout
from kvpager.engine.executor import config_from_json, config_to_json
from kvpager.model.spec import load_model_spec
from kvpager.model.tp_shards import shard_plan


def test_kv_heads_split_when_the_ranks_divide_them() -> None:
    layout = tensor_parallel_layout(32, 8, 11008, 32000, 4)
    assert (layout.heads_per_rank, layout.kv_heads_per_rank, layout.intermediate_per_rank) == (8, 2, 2752)
    assert [layout.kv_head_start(r) for r in range(4)] == [0, 2, 4, 6]
    assert not layout.kv_heads_replicated


def test_kv_heads_replicated_when_fewer_than_the_ranks() -> None:
    layout = tensor_parallel_layout(8, 2, 64, 100, 4)
    assert layout.kv_heads_replicated and layout.kv_heads_per_rank == 1
    # ranks 0, 1 hold query heads 0-3, which use KV head 0; ranks 2, 3 heads 4-7 (KV head 1)
    assert [layout.kv_head_start(r) for r in range(4)] == [0, 0, 1, 1]


def test_vocab_rows_split_with_the_last_shard_short() -> None:
    layout = tensor_parallel_layout(4, 2, 8, 383, 2)
    assert layout.vocab_per_rank == 192
    assert [layout.vocab_range(r) for r in range(2)] == [(0, 192), (192, 383)]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "inter", "n", "message"),
    [
        (12, 4, 64, 8, "must divide the model's 12 attention heads"),
        (12, 6, 64, 4, "must divide the model's 6 KV heads"),
        (8, 3, 64, 4, "not a multiple"),
        (8, 8, 60, 8, "must divide the model's intermediate_size 60"),
        (8, 8, 64, 0, "must be >= 1"),
    ],
)
def test_layouts_that_do_not_divide_are_refused_naming_the_problem(
    heads: int, kv_heads: int, inter: int, n: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        tensor_parallel_layout(heads, kv_heads, inter, 100, n)


def test_shard_plan_takes_each_ranks_heads_from_q_k_and_v(llama_checkpoint: Path) -> None:
    spec = load_model_spec(str(llama_checkpoint))  # 4 heads, 2 KV heads, head_dim 16
    layout = tensor_parallel_layout(spec.num_heads, spec.num_kv_heads, spec.intermediate_size, spec.vocab_size, 2)
    plan = shard_plan("layers.0.self_attn.qkv_proj.weight", spec, layout, 1)
    assert plan is not None and plan.dim == 0
    assert plan.ranges == ((32, 64), (64 + 16, 64 + 32), (96 + 16, 96 + 32))
    o_plan = shard_plan("layers.0.self_attn.o_proj.weight", spec, layout, 1)
    assert o_plan is not None and (o_plan.dim, o_plan.ranges) == (1, ((32, 64),))
    assert shard_plan("layers.0.input_layernorm.weight", spec, layout, 1) is None
    bias = shard_plan("layers.0.mlp.down_proj.bias", spec, layout, 1)
    assert bias is not None and bias.zero and shard_plan("layers.0.mlp.down_proj.bias", spec, layout, 0) is None


def test_step_message_round_trips_as_json() -> None:
    params = SamplingParams(
        temperature=0.7,
        seed=2**63,
        stop=["x"],
        logit_bias={5: -3.5},
        prompt_logprobs=2,
        structured=StructuredOutputSpec("regex", "a+"),
    )
    out = SchedulerOutput(
        scheduled=(
            ScheduledRequest(RequestId("a"), 3, 0, (4, 9), True),
            ScheduledRequest(RequestId("b"), 1, 7, (), False),
        ),
        new_requests=(NewRequestData(RequestId("a"), (1, 2, 3), params, (4, 9)),),
        preempted_ids=(RequestId("c"),),
        finished_ids=(RequestId("d"),),
    )
    h1, h2 = BlockHash(bytes(range(32))), BlockHash(b"\xff" * 32)
    ops = TierOps(
        offloads=((7, h1),),
        publishes=((5, h2),),
        loads=((3, ((h2, 4), (h1, 9))),),
        fills=(2, 8),
        gathers=(6,),
        flush=True,
    )
    message = StepMessage(OP_STEP, out, {RequestId("b"): 42}, ops)
    payload = encode_step(message)
    json.loads(payload)  # plain JSON: no pickle anywhere
    assert decode_step(payload) == message
    assert decode_step(encode_step(StepMessage(OP_STOP))) == StepMessage(OP_STOP)


@pytest.mark.parametrize("payload", [b"", b"\x80\x04", b'{"op": "exec", "sampled": []}', b'{"op": "step"}'])
def test_malformed_step_messages_are_refused(payload: bytes) -> None:
    with pytest.raises(ValueError, match="malformed tensor-parallel step message"):
        decode_step(payload)


def test_config_travels_to_the_workers_as_json() -> None:
    config = EngineConfig(model="m", tensor_parallel_size=2, max_num_seqs=3, distributed_master_port=1234)
    assert config_from_json(config_to_json(config)) == config


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be >= 1"),
        ({"nnodes": 3}, "--tensor-parallel-size 2 is not a multiple of --nnodes 3"),
        ({"nnodes": 2}, "--nnodes 2 needs --master-addr"),
        (
            {"nnodes": 2, "node_rank": 2, "distributed_master_addr": "h", "distributed_master_port": 1},
            "node_rank must be in 0..1",
        ),
        ({"kernel_backend": "cpu"}, "--kernel-backend cpu cannot be combined"),
        ({"distributed_master_port": 70000}, "distributed_master_port must be in 1..65535"),
    ],
)
def test_config_refuses_what_tensor_parallelism_cannot_do(fields: dict[str, object], message: str) -> None:
    base = {"tensor_parallel_size": 2, **fields}
    with pytest.raises(ValueError, match=message):
        EngineConfig(**base)  # type: ignore[arg-type]


def test_every_kv_tier_and_packs_are_accepted_with_tensor_parallelism_and_nodes_split_the_ranks() -> None:
    config = EngineConfig(
        tensor_parallel_size=4,
        host_kv_cache_memory=1 << 20,
        kv_cache_dir="kv",
        kv_cache_remote="redis://10.0.0.2:6379",
        kv_packs=("system.kvpack",),
        nnodes=2,
        node_rank=1,
        distributed_master_addr="10.0.0.1",
        distributed_master_port=29500,
    )
    assert config.ranks_per_node == 2 and list(config.node_ranks) == [2, 3]


def test_serve_parses_vllms_multi_node_flags_and_the_old_spellings() -> None:
    from kvpager.cli.serve import build_parser
    from kvpager.engine.args import config_from_args

    common = ["-tp", "2", "--nnodes", "2", "--node-rank", "1", "--headless"]
    for addr_flag, port_flag in (
        ("--master-addr", "--master-port"),
        ("--distributed-master-addr", "--distributed-master-port"),
    ):
        args = build_parser().parse_args([*common, addr_flag, "10.1.2.3", port_flag, "29501"])
        config = config_from_args(args)
        assert args.headless and (config.nnodes, config.node_rank) == (2, 1)
        assert (config.distributed_master_addr, config.distributed_master_port) == ("10.1.2.3", 29501)


def test_engine_refuses_a_tp_size_that_does_not_divide_the_heads_before_starting_workers(
    llama_checkpoint: Path,
) -> None:
    from kvpager.engine.engine import Engine

    with pytest.raises(ValueError, match="tensor_parallel_size 3 must divide the model's 4 attention heads"):
        Engine(EngineConfig(model=str(llama_checkpoint), tensor_parallel_size=3, kv_cache_memory=1 << 20))


@pytest.mark.parametrize(("tp", "kv_heads"), [(1, 2), (2, 1), (4, 1)])
def test_plan_reports_the_per_rank_block_count_the_engine_allocates(
    tp: int, kv_heads: int, llama_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The engine's per-rank pool is `pool_size` over the shard's KV heads (loading.load): the same
    function and layout the planner calls, so the numbers agree; the TP=2 engine test pins the engine's."""
    model = llama_checkpoint  # 2 KV heads
    budget = 3 << 20
    assert (
        plan_main([str(model), "--kv-cache-memory", str(budget), "--kv-dtype", "fp32", "-tp", str(tp), "--json"]) == 0
    )
    plan = json.loads(capsys.readouterr().out)
    spec = load_model_spec(str(model))
    shard = replace(spec, num_kv_heads=kv_heads)
    assert plan["engine_kv_heads_per_rank"] == kv_heads
    assert plan["engine_num_blocks"] == pool_size(shard.kv_shape(4), 16, budget).num_blocks
