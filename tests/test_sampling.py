"""SamplingParams validation and the batched Sampler: filters, penalties, seeds, logprobs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvpager.core.sampling_params import SamplingParams
from kvpager.worker.sampler import (
    Sampler,
    SamplingRow,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    make_generator,
    row_argmax,
)

torch.set_num_threads(1)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _logits(batch: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3.0


def _rows(params: SamplingParams, batch: int) -> list[SamplingRow]:
    return [SamplingRow(params=params) for _ in range(batch)]


# --- SamplingParams ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 17}, "min_tokens"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
    ],
)
def test_invalid_sampling_params_raise_value_error_naming_the_parameter(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_sampling_params_defaults_follow_vllm_and_normalise_stop() -> None:
    params = SamplingParams(stop="###")
    assert (params.n, params.temperature, params.top_p, params.top_k, params.max_tokens) == (1, 1.0, 1.0, 0, 16)
    assert params.stop == ["###"] and params.stop_strings == ["###"] and params.stop_token_ids == []
    assert SamplingParams().stop_strings == []
    assert not SamplingParams(top_k=0).top_k_enabled and not SamplingParams(top_k=-1).top_k_enabled
    assert SamplingParams(temperature=0.0).is_greedy and not SamplingParams(temperature=1e-4).is_greedy
    assert SamplingParams(max_tokens=None, min_tokens=100).max_tokens is None


def test_resolve_max_tokens_caps_at_the_context_and_rejects_a_full_prompt() -> None:
    assert SamplingParams(max_tokens=None).resolve_max_tokens(100, 30) == 70
    assert SamplingParams(max_tokens=10).resolve_max_tokens(100, 30) == 10
    assert SamplingParams(max_tokens=90).resolve_max_tokens(100, 30) == 70
    with pytest.raises(ValueError, match="max_model_len"):
        SamplingParams().resolve_max_tokens(100, 100)


# --- filters ----------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_rows_take_the_argmax(device: str) -> None:
    logits = _logits(6).to(device)
    result = Sampler().sample(logits, _rows(SamplingParams(temperature=0.0), 6))
    assert torch.equal(result.token_ids, logits.argmax(dim=-1))
    assert result.logprobs is None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "params", [SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(min_p=1.0, temperature=1.5)]
)
def test_degenerate_filters_equal_greedy(device: str, params: SamplingParams) -> None:
    logits = _logits(64, seed=1).to(device)
    result = Sampler(seed=3).sample(logits, _rows(params, 64))
    assert torch.equal(result.token_ids, logits.argmax(dim=-1))


def test_min_p_masks_tokens_below_fraction_of_the_top_probability() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]])
    masked = apply_min_p(probs.log(), torch.tensor([0.5, 0.5]))
    # row 0: threshold 0.25 keeps 0.5 and 0.3; row 1: everything equals the max.
    assert torch.isinf(masked).tolist() == [[False, False, True, True], [False, False, False, False]]


def test_top_k_top_p_keep_exactly_the_expected_tokens() -> None:
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]] * 3)
    masked = apply_top_k_top_p(probs.log(), torch.tensor([2, 4, 4]), torch.tensor([1.0, 0.6, 0.75]))
    kept = (~torch.isinf(masked)).tolist()
    assert kept == [[True, True, False, False], [True, True, False, False], [True, True, True, False]]
    assert torch.allclose(masked[~torch.isinf(masked)], probs.log()[~torch.isinf(masked)])


def _reference_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Plain per-row full-sort nucleus, the definition the batched version must reproduce."""
    out = logits.clone()
    for i, (k, p) in enumerate(zip(top_k, top_p, strict=True)):
        row = out[i]
        row[row < row.topk(k).values[-1]] = float("-inf")
        if p < 1.0:
            probs, order = torch.softmax(row, dim=-1).sort(descending=True)
            mass_above = probs.cumsum(dim=-1) - probs
            row[order[1:][mass_above[1:] >= p]] = float("-inf")
    return out


@pytest.mark.parametrize("scale", [0.05, 1.0, 8.0])  # flat rows exercise the full-sort fallback
def test_top_k_top_p_equal_a_per_row_full_sort_reference(scale: float) -> None:
    vocab = 1000
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(5)) * scale
    top_k, top_p = [vocab, 40, vocab, 700, 1, vocab], [0.9, 1.0, 0.5, 0.95, 0.3, 1.0]
    masked = apply_top_k_top_p(logits, torch.tensor(top_k), torch.tensor(top_p))
    expected = _reference_top_k_top_p(logits, top_k, top_p)
    assert torch.equal(torch.isinf(masked), torch.isinf(expected))
    assert not torch.isinf(masked[5]).any()  # a row with both filters off keeps everything
    assert int((~torch.isinf(masked[1])).sum()) == 40


def _chi_square(token_ids: torch.Tensor, expected_probs: torch.Tensor) -> float:
    counts = torch.bincount(token_ids, minlength=expected_probs.numel()).double()
    expected = expected_probs.double() * token_ids.numel()
    support = expected > 0
    assert counts[~support].sum() == 0, "sampled a token with zero probability"
    return float(((counts[support] - expected[support]) ** 2 / expected[support]).sum())


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_sampling_matches_the_tempered_softmax(temperature: float) -> None:
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0])
    num_draws = 20000
    tokens = (
        Sampler(seed=0)
        .sample(row.expand(num_draws, -1).contiguous(), _rows(SamplingParams(temperature=temperature), num_draws))
        .token_ids
    )
    expected = torch.softmax(row / temperature, dim=-1)
    # 7 degrees of freedom: P(chi2 > 24.3) = 0.001; the fixed seed makes the test deterministic.
    assert _chi_square(tokens, expected) < 24.3
    wrong = torch.softmax(row / (temperature * 1.5), dim=-1)
    assert _chi_square(tokens, wrong) > 24.3  # the test can tell temperatures apart


def test_top_k_and_top_p_sampling_renormalise_over_the_kept_tokens() -> None:
    row = torch.tensor([0.4, 0.3, 0.2, 0.06, 0.04]).log()
    num_draws = 20000
    params = SamplingParams(top_k=4, top_p=0.85)  # top-k keeps 4, top-p then keeps 0.4, 0.3, 0.2
    tokens = Sampler(seed=1).sample(row.expand(num_draws, -1).contiguous(), _rows(params, num_draws)).token_ids
    expected = torch.tensor([0.4, 0.3, 0.2, 0.0, 0.0]) / 0.9
    assert _chi_square(tokens, expected) < 13.8  # 2 degrees of freedom, p = 0.001


# --- penalties and min_tokens -----------------------------------------------------------------


def test_penalties_change_logits_exactly_as_hand_computed() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    row = SamplingRow(params=params, prompt_token_ids=[0, 4], output_token_ids=[1, 1, 2])
    out = apply_penalties(logits, [row])
    # token 0: prompt only -> 2/2 = 1.0; token 1: output x2 -> -1*2 - 0.5*2 - 0.25 = -3.25
    # token 2: output x1 -> 0.5/2 - 0.5 - 0.25 = -0.5; token 3: unseen -> 3.0; token 4: prompt -> -2*2 = -4
    assert out.tolist() == [[1.0, -3.25, -0.5, 3.0, -4.0]]
    plain = SamplingRow(params=SamplingParams(), prompt_token_ids=[0], output_token_ids=[1])
    assert torch.equal(apply_penalties(logits, [plain]), logits)


def test_penalised_greedy_row_avoids_the_repeated_token() -> None:
    logits = torch.tensor([[5.0, 4.9, 0.0]])
    rows = [SamplingRow(params=SamplingParams(temperature=0.0, presence_penalty=1.0), output_token_ids=[0])]
    assert Sampler().sample(logits, rows).token_id_list() == [1]


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.tensor([[0.0, 9.0, 8.0, 1.0]] * 2)
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2])
    early = SamplingRow(params=params, output_token_ids=[3], eos_token_ids=[1])
    done = SamplingRow(params=params, output_token_ids=[3, 3], eos_token_ids=[1])
    assert Sampler().sample(logits, [early, done]).token_id_list() == [3, 1]
    assert logits[0, 1] == 9.0  # the caller's logits are not modified


# --- seeds ------------------------------------------------------------------------------------


def _run_steps(
    sampler: Sampler, rows: list[SamplingRow], keys: list[int], num_steps: int, vocab: int = 40
) -> list[list[int]]:
    """Sample num_steps tokens per row; a row's logits at each step depend only on its key and the step."""
    outputs: list[list[int]] = [[] for _ in rows]
    for step in range(num_steps):
        logits = torch.stack([_logits(1, vocab, seed=1000 * step + key)[0] * 0.3 for key in keys])
        for i, token in enumerate(sampler.sample(logits, rows).token_id_list()):
            outputs[i].append(token)
            rows[i].output_token_ids = [*rows[i].output_token_ids, token]
    return outputs


def test_seeded_request_yields_the_same_tokens_alone_and_in_a_mixed_batch() -> None:
    seeded = SamplingParams(seed=1234, temperature=1.0, top_p=0.95, frequency_penalty=0.2)
    other_seeded = SamplingParams(seed=99, top_k=5)
    unseeded = SamplingParams(temperature=0.8)
    greedy = SamplingParams(temperature=0.0)

    def row(params: SamplingParams) -> SamplingRow:
        generator = make_generator(params.seed) if params.seed is not None else None
        return SamplingRow(params=params, prompt_token_ids=[1, 2, 3], generator=generator)

    alone = _run_steps(Sampler(seed=0), [row(seeded)], [1], 12)[0]
    batch = [row(unseeded), row(other_seeded), row(seeded), row(greedy), row(unseeded)]
    mixed = _run_steps(Sampler(seed=7), batch, [3, 2, 1, 4, 5], 12)
    assert mixed[2] == alone
    other_alone = _run_steps(Sampler(seed=5), [row(other_seeded)], [2], 12)[0]
    assert mixed[1] == other_alone
    reseeded = _run_steps(Sampler(seed=0), [row(dataclasses.replace(seeded, seed=4321))], [1], 12)[0]
    assert reseeded != alone  # the seed, not the logits alone, decides the tokens


# --- logprobs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_raw_log_softmax_with_sorted_top_k(device: str) -> None:
    logits = _logits(3, seed=4).to(device)
    rows = [
        SamplingRow(
            params=SamplingParams(logprobs=5, temperature=0.7, repetition_penalty=1.3), output_token_ids=[0, 1]
        ),
        SamplingRow(params=SamplingParams()),
        SamplingRow(params=SamplingParams(logprobs=0, temperature=0.0)),
    ]
    result = Sampler().sample(logits, rows)
    reference = torch.log_softmax(logits, dim=-1).cpu()
    assert result.logprobs is not None and result.logprobs[1] is None
    first, third = result.logprobs[0], result.logprobs[2]
    assert first is not None and third is not None
    tokens = result.token_id_list()
    assert first.token_id == tokens[0] and first.logprob == pytest.approx(float(reference[0, tokens[0]]), abs=1e-6)
    top_values, top_ids = reference[0].topk(5)
    assert [t for t, _ in first.top] == top_ids.tolist()
    assert [v for _, v in first.top] == pytest.approx(top_values.tolist(), abs=1e-6)
    assert third.top == [] and third.logprob == pytest.approx(float(reference[2].max()), abs=1e-6)


def test_shape_mismatch_raises_value_error() -> None:
    with pytest.raises(ValueError, match="len\\(rows\\)"):
        Sampler().sample(torch.zeros(2, 5), _rows(SamplingParams(), 3))


@pytest.mark.parametrize("vocab", [49152, 32000, 151936, 1000, 4096, 7, 320])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_row_argmax_equals_torch_argmax(rows: int, vocab: int) -> None:
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab + rows))
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))


def test_row_argmax_keeps_torch_ties_nan_and_all_minus_inf() -> None:
    x = torch.zeros(6, 4096)
    x[1, 3000] = x[1, 5] = 2.0  # tie across chunks: the first
    x[2, 1030] = x[2, 1029] = 1.0  # tie inside a chunk: the first
    x[3, 2000] = float("nan")
    x[3, 100] = 5.0
    x[3, 4000] = float("nan")  # NaN wins, the first NaN
    x[4] = float("-inf")  # all -inf: index 0
    x[5, 4095] = 1.0  # the very last column
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))
    assert row_argmax(x).tolist() == [0, 5, 1029, 2000, 0, 4095]


def test_row_argmax_reads_a_non_contiguous_batch() -> None:
    x = torch.randn(8, 8192, generator=torch.Generator().manual_seed(0))[::2]
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))
