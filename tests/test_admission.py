"""Admission is atomic: a request the engine refuses, for any reason, leaves the engine exactly as it
was, and the engine keeps serving (issue 16, item 1: an out-of-range seed used to stay queued and
kill the engine for good)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpager.core.config import EngineConfig
from kvpager.core.limits import RequestLimits
from kvpager.core.sampling_params import SamplingParams
from kvpager.engine.engine import Engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
VALID_PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [5, 6, 7, 8, 20, 21]]


@pytest.fixture(scope="module")
def engine(llama_checkpoint: Path) -> Engine:
    return Engine(EngineConfig(model=str(llama_checkpoint), kv_cache_memory=1 << 21, block_size=4))


def engine_state(engine: Engine) -> dict[str, Any]:
    """Everything a refused request could have touched."""
    sched = engine.scheduler
    return {
        "scheduler_requests": sorted(sched.requests),
        "waiting": [r.request_id for r in sched.waiting],
        "running": [r.request_id for r in sched.running],
        "runner_rows": sorted(engine.runner._rows),
        "parents": sorted(engine.outputs.parents),
        "seqs": sorted(engine.outputs.seqs),
        "stats": engine.stats(),
    }


def run_all(engine: Engine) -> dict[str, list[int]]:
    finals: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0].token_ids
    return finals


def greedy_reference(engine: Engine) -> dict[str, list[int]]:
    for i, prompt in enumerate(VALID_PROMPTS):
        engine.add_request(f"ref-{i}", prompt, GREEDY)
    return {k.removeprefix("ref-"): v for k, v in run_all(engine).items()}


@pytest.mark.parametrize(
    "params",
    [
        # the exact failing requests of issue 16: seed 2**64 (n=1) and seed 2**64-1 with n=2
        SamplingParams(seed=2**64, temperature=1.0),
        SamplingParams(seed=2**64 - 1, temperature=1.0, n=2),
        SamplingParams(seed=-(2**63) - 1, temperature=1.0),
    ],
)
def test_out_of_range_seed_is_refused_or_served_and_the_engine_keeps_serving(
    engine: Engine, params: SamplingParams
) -> None:
    reference = greedy_reference(engine)
    before = engine_state(engine)
    try:
        engine.add_request("seeded", "x", params)
    except ValueError as exc:
        assert "seed" in str(exc)
        assert engine_state(engine) == before
    else:  # 2**64-1 with n=2 is in range: sample 1's seed wraps to 0 and both samples run
        assert params.seed is not None and params.seed <= 2**64 - 1
        assert len(run_all(engine)) == 1
    assert greedy_reference(engine) == reference


def test_a_failure_inside_queueing_is_undone(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Even a failure admission cannot foresee (here: the scheduler raising on the 2nd of 3 samples)
    leaves scheduler, runner and output processor exactly as before."""
    reference = greedy_reference(engine)
    before = engine_state(engine)
    real_add = engine.scheduler.add_request
    calls: list[Any] = []

    def failing_add(request: Any) -> None:
        calls.append(request)
        if len(calls) == 2:
            raise RuntimeError("injected scheduler failure")
        real_add(request)

    monkeypatch.setattr(engine.scheduler, "add_request", failing_add)
    with pytest.raises(RuntimeError, match="injected"):
        engine.add_request("boom", [5, 6, 7], SamplingParams(n=3, max_tokens=4))
    monkeypatch.undo()
    assert engine_state(engine) == before
    assert greedy_reference(engine) == reference


def test_sequence_id_of_a_running_sample_cannot_be_reused(engine: Engine) -> None:
    engine.add_request("p", [5, 6, 7], SamplingParams(n=2, max_tokens=3, ignore_eos=True))
    before = engine_state(engine)
    with pytest.raises(ValueError, match="collides"):
        engine.add_request("p#1", [5, 6], GREEDY)
    assert engine_state(engine) == before
    assert len(run_all(engine)) == 1


@pytest.mark.parametrize(
    ("limits", "params", "flag"),
    [
        (RequestLimits(max_stop_token_ids=4), SamplingParams(stop_token_ids=list(range(5))), "--max-stop-token-ids"),
        (RequestLimits(max_stop_strings=2), SamplingParams(stop=["a", "b", "c"]), "--max-stop-strings"),
        (RequestLimits(max_stop_string_chars=3), SamplingParams(stop=["abcd"]), "--max-stop-string-chars"),
        (RequestLimits(max_logprobs=2), SamplingParams(logprobs=3), "--max-logprobs"),
        (RequestLimits(max_sequences_per_request=4), SamplingParams(n=5), "--max-sequences-per-request"),
    ],
)
def test_per_request_limits_name_their_flag(
    llama_checkpoint: Path, limits: RequestLimits, params: SamplingParams, flag: str
) -> None:
    engine = Engine(EngineConfig(model=str(llama_checkpoint), kv_cache_memory=1 << 20, request_limits=limits))
    with pytest.raises(ValueError, match=flag):
        engine.add_request("r", [5, 6, 7], params)
    assert not engine.has_unfinished_requests()


def test_default_limits_refuse_the_issue_16_stop_token_flood(engine: Engine) -> None:
    before = engine_state(engine)
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.add_request("flood", [5, 6, 7], SamplingParams(stop_token_ids=list(range(100_000))))
    assert engine_state(engine) == before


# -- property: random invalid requests between valid ones -----------------------------------------
_BAD_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "seed": st.one_of(st.integers(min_value=2**64), st.integers(max_value=-(2**63) - 1)),
    "temperature": st.sampled_from([float("nan"), float("inf")]),
    "repetition_penalty": st.sampled_from([float("inf")]),
    "n": st.integers(min_value=300, max_value=10**6),
    "logprobs": st.integers(min_value=21, max_value=10**4),
    "stop_token_ids": st.lists(st.integers(min_value=2**63, max_value=2**80), min_size=1, max_size=3),
    "stop": st.just(["\ud800"]),
    "max_tokens": st.integers(min_value=10**6, max_value=10**9),
}
_BAD_PROMPTS = st.one_of(
    st.lists(st.integers(min_value=384, max_value=2**70), min_size=1, max_size=5),
    st.lists(st.integers(max_value=-1), min_size=1, max_size=5),
    st.just("\ud800 lone surrogate"),
    st.just([]),
    st.just(list(range(3, 300))),
)


@st.composite
def invalid_request(draw: st.DrawFn) -> tuple[Any, dict[str, Any]]:
    if draw(st.booleans()):
        return draw(_BAD_PROMPTS), {"temperature": 0.0, "max_tokens": 4}
    name = draw(st.sampled_from(sorted(_BAD_VALUES)))
    return [5, 6, 7], {"temperature": 0.5, "max_tokens": 4, name: draw(_BAD_VALUES[name])}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(bad=st.lists(invalid_request(), min_size=1, max_size=4))
def test_random_invalid_requests_between_valid_ones_never_change_the_engine_or_greedy_outputs(
    engine: Engine, bad: list[tuple[Any, dict[str, Any]]]
) -> None:
    reference = _REFERENCE.setdefault("greedy", greedy_reference(engine))
    for i, prompt in enumerate(VALID_PROMPTS):
        engine.add_request(f"ok-{i}", prompt, GREEDY)
        engine.step()  # the valid requests are mid-flight while the bad ones arrive
        for j, (bad_prompt, fields) in enumerate(bad):
            before = engine_state(engine)
            try:
                params = SamplingParams(**fields)
                engine.add_request(f"bad-{i}-{j}", bad_prompt, params)
            except ValueError:
                pass
            else:
                pytest.fail(f"accepted an invalid request: {bad_prompt!r} {fields}")
            assert engine_state(engine) == before
    outputs = {k.removeprefix("ok-"): v for k, v in run_all(engine).items()}
    assert outputs == reference
    assert engine.stats().num_owned_blocks == 0


_REFERENCE: dict[str, dict[str, list[int]]] = {}
