"""IncrementalDetokenizer (multi-byte characters across tokens) and StopChecker (stop strings across deltas)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from kvpager.text.detokenizer import IncrementalDetokenizer, StopChecker
from kvpager.text.tokenizer import Tokenizer

ENGLISH = (
    "the quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun and we talk about text".split()
)
CHINESE = "你好世界，今天天气很好。我们学习机器学习和自然语言处理。"
MIXED = "Hello 你好世界! The fox 😀 jumps 🚀🎉 over 机器学习 the dog. 自然语言 done"


def _corpus() -> list[str]:
    return [" ".join(ENGLISH[i:] + ENGLISH[:i]) for i in range(len(ENGLISH))] + [CHINESE]


@pytest.fixture(scope="module")
def byte_level() -> HFTokenizer:
    """A ByteLevel BPE with ~300 entries: merges go to English, so CJK and emoji stay split into bytes."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    return tok


@pytest.fixture(scope="module")
def metaspace() -> HFTokenizer:
    """A Llama-style SentencePiece BPE: "▁" word prefix, byte fallback, leading space stripped on decode."""
    tok = HFTokenizer(models.BPE(byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(_corpus()[:-1], trainer)
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    for byte in range(256):  # byte-fallback pieces live in the model vocab, as in Llama's tokenizer
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    return HFTokenizer.from_str(json.dumps(data))


def _stream(
    tok: HFTokenizer, prompt_ids: list[int], output_ids: list[int], skip_special_tokens: bool = True
) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip_special_tokens)
    return [detok.add(token_id) for token_id in output_ids]


def test_byte_level_bpe_splits_cjk_and_emoji_into_broken_single_tokens(byte_level: HFTokenizer) -> None:
    # Guard: the streaming tests below only mean something if single tokens decode to U+FFFD.
    ids = byte_level.encode(MIXED).ids
    assert sum("\ufffd" in byte_level.decode([i]) for i in ids) >= 10


@pytest.mark.parametrize("prompt", ["", "Say: ", "提示 😀 "])
def test_deltas_concatenate_to_the_full_decode_without_broken_characters(byte_level: HFTokenizer, prompt: str) -> None:
    prompt_ids = byte_level.encode(prompt).ids
    output_ids = byte_level.encode(MIXED).ids
    deltas = _stream(byte_level, prompt_ids, output_ids)
    assert "".join(deltas) == MIXED == byte_level.decode(output_ids)
    assert not any("\ufffd" in d for d in deltas)
    assert sum(d == "" for d in deltas) >= 10  # characters were held back until complete


def test_metaspace_spacing_matches_the_full_decode(metaspace: HFTokenizer) -> None:
    prompt_ids = metaspace.encode("the quick brown fox").ids
    output_ids = metaspace.encode(" jumps over 你好 the lazy dog 😀").ids[1:]  # drop the lone "▁" piece
    deltas = _stream(metaspace, prompt_ids, output_ids)
    full = metaspace.decode(prompt_ids + output_ids)
    assert metaspace.decode(prompt_ids) + "".join(deltas) == full
    assert "你好" in full and not any("\ufffd" in d for d in deltas)


def test_special_tokens_are_skipped_or_kept_as_asked(byte_level: HFTokenizer) -> None:
    eos = byte_level.token_to_id("</s>")
    output_ids = byte_level.encode("the fox").ids + [eos] + byte_level.encode(" 你好").ids
    assert "".join(_stream(byte_level, [], output_ids)) == "the fox 你好"
    assert "".join(_stream(byte_level, [], output_ids, skip_special_tokens=False)) == "the fox</s> 你好"


def test_works_through_the_kvpager_tokenizer(byte_level: HFTokenizer, tmp_path) -> None:
    byte_level.save(str(tmp_path / "tokenizer.json"))
    tokenizer = Tokenizer.from_dir(tmp_path)
    output_ids = tokenizer.encode(MIXED, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("hi "), skip_special_tokens=True)
    assert "".join(detok.add(t) for t in output_ids) == MIXED == detok.output_text


def test_flush_returns_an_incomplete_trailing_character(byte_level: HFTokenizer) -> None:
    ids = byte_level.encode("ok 😀").ids
    detok = IncrementalDetokenizer(byte_level, [])
    text = "".join(detok.add(t) for t in ids[:-1])  # the emoji's last byte never arrives
    assert "\ufffd" not in text and text == "ok "
    assert detok.flush() == "\ufffd" and detok.flush() == ""


# --- StopChecker ------------------------------------------------------------------------------


def _feed_all(checker: StopChecker, deltas: list[str]) -> tuple[str, bool, str | None]:
    emitted, stopped, matched = "", False, None
    for delta in deltas:
        text, stopped, matched = checker.feed(delta)
        emitted += text
        if stopped:
            break
    return emitted, stopped, matched


def test_stop_string_split_across_deltas_is_found_and_cut() -> None:
    assert _feed_all(StopChecker(["STOP"]), ["Hel", "lo ST", "OP more"]) == ("Hello ", True, "STOP")
    assert _feed_all(StopChecker(["STOP"], include_in_output=True), ["Hel", "lo ST", "OP more"]) == (
        "Hello STOP",
        True,
        "STOP",
    )


def test_possible_stop_prefix_is_held_back_until_decided() -> None:
    checker = StopChecker(["</end>"])
    assert checker.feed("abc </") == ("abc ", False, None)
    assert checker.feed("en") == ("", False, None)
    assert checker.feed("try") == ("</entry", False, None)
    assert checker.feed(" </e") == (" ", False, None)
    assert checker.flush() == "</e"


def test_stop_that_completes_first_wins_and_feed_after_stop_is_empty() -> None:
    checker = StopChecker(["xyz", "y", "zz"])
    assert checker.feed("abxyzz") == ("abx", True, "y")
    assert checker.feed("more") == ("", True, "y") and checker.flush() == ""
    assert StopChecker([]).feed("anything") == ("anything", False, None)
    with pytest.raises(ValueError, match="non-empty"):
        StopChecker(["ok", ""])


def _reference(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not found:
        return text, None
    _, start, stop = min(found, key=lambda f: (f[0], f[1]))
    return text[: start + (len(stop) if include else 0)], stop


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab c", max_size=40),
    stops=st.lists(st.text(alphabet="ab c", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=10),
    include=st.booleans(),
)
def test_streamed_result_equals_the_whole_text_result_for_any_split(
    text: str, stops: list[str], cuts: list[int], include: bool
) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    checker = StopChecker(stops, include_in_output=include)
    emitted, stopped, matched = _feed_all(checker, deltas)
    if not stopped:
        emitted += checker.flush()
    assert (emitted, matched) == _reference(text, stops, include)
