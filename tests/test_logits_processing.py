"""logit_bias and grammar bitmasks in the batched sampler; structured-output grammars (llguidance)."""

from __future__ import annotations

import json

import pytest
import torch

from kvpager.core.sampling_params import SamplingParams, StructuredOutputSpec
from kvpager.worker.logits_processing import apply_token_bitmask, bitmask_to_bool
from kvpager.worker.sampler import Sampler, SamplingRow

VOCAB = 70


def _row(**kw: object) -> SamplingRow:
    return SamplingRow(params=SamplingParams(**kw))  # type: ignore[arg-type]


def test_logit_bias_plus_100_forces_and_minus_100_forbids_a_token_per_row() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    best = logits.argmax(dim=-1)
    rows = [
        _row(temperature=0.0, logit_bias={7: 100.0}),
        _row(temperature=0.0, logit_bias={int(best[1]): -100.0}),
        _row(temperature=0.0),
    ]
    got = Sampler().sample(logits, rows).token_ids.tolist()
    assert got[0] == 7
    assert got[1] != int(best[1]) and got[1] == int(logits[1].topk(2).indices[1])
    assert got[2] == int(best[2])  # rows without a bias are untouched


def test_logit_bias_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 101.0})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={-1: 1.0})


def test_bitmask_allows_exactly_the_set_bits_and_only_in_its_rows() -> None:
    allowed = [3, 31, 32, 69]
    words = torch.zeros(1, (VOCAB + 31) // 32, dtype=torch.int64)
    for t in allowed:
        words[0, t // 32] |= 1 << (t % 32)
    bitmask = words.to(torch.int32)  # bit 31 wraps to the sign bit, as llguidance writes it
    assert bitmask_to_bool(bitmask, VOCAB)[0].nonzero().squeeze(1).tolist() == allowed
    logits = torch.zeros(2, VOCAB)
    masked = apply_token_bitmask(logits, bitmask, [1])
    assert torch.isfinite(masked[0]).all()
    assert torch.isfinite(masked[1]).nonzero().squeeze(1).tolist() == allowed
    rows = [_row(temperature=1.0, seed=s) for s in range(2)]
    for _ in range(5):
        token = Sampler().sample(torch.randn(2, VOCAB), rows, bitmask, [1]).token_ids[1]
        assert int(token) in allowed


@pytest.fixture(scope="module")
def compiler():  # type: ignore[no-untyped-def]
    from pathlib import Path

    from kvpager.text.tokenizer import Tokenizer
    from kvpager.worker.structured import GrammarCompiler

    tok = Tokenizer.from_dir(Path(__file__).resolve().parent.parent / "kvpager" / "demo_model")
    return GrammarCompiler(tok.backend_json(), 4096, tok.eos_token_ids), tok


def test_compiled_grammars_are_cached_and_bad_ones_raise_naming_the_problem(compiler) -> None:  # type: ignore[no-untyped-def]
    grammar, _ = compiler
    spec = StructuredOutputSpec("regex", "(yes|no)")
    assert grammar.compile(spec) is grammar.compile(StructuredOutputSpec("regex", "(yes|no)"))
    with pytest.raises(ValueError, match="regex"):
        grammar.compile(StructuredOutputSpec("regex", "(unclosed")).result()
    with pytest.raises(ValueError, match="json"):
        grammar.compile(StructuredOutputSpec("json", json.dumps({"type": "nonsense"}))).result()


def test_matcher_masks_lead_any_sampler_to_the_grammar(compiler) -> None:  # type: ignore[no-untyped-def]
    from kvpager.worker.structured import advance, fill_bitmask

    grammar, tok = compiler
    matcher = grammar.matcher(StructuredOutputSpec("choice", json.dumps(["Jerusalem", "Bethlehem"])))
    sampler = Sampler()
    out: list[int] = []
    row = _row(temperature=1.0, seed=3)
    for _ in range(20):
        bitmask = fill_bitmask([matcher], 4096)
        token = int(sampler.sample(torch.randn(1, 4096), [row], bitmask, [0]).token_ids[0])
        if token in tok.eos_token_ids:
            break
        out.append(token)
        advance(matcher, token)
    assert tok.decode(out) in ("Jerusalem", "Bethlehem")
