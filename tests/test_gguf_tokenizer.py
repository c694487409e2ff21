"""The tokenizer rebuilt from GGUF metadata gives transformers' GGUF tokenizer conversion's ids on mixed
English/Chinese/code text, and renders the file's chat template identically.

Reference: transformers' `AutoTokenizer.from_pretrained(dir, gguf_file=...)` (its own conversion of
the same metadata; llama.cpp's llama-tokenize is not available here).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from checkpoints import make_llama_checkpoint, make_qwen2_checkpoint
from gguf_files import write_gguf

from kvpager.engine.loading import load_tokenizer
from kvpager.gguf import open_gguf
from kvpager.text.gguf_tokenizer import merges_from_scores, tokenizer_from_gguf

TEXT = (
    "The quick brown fox, 你好世界！缓存块 and KV cache.\n"
    "def main(x):\n    return x ** 2  # 平方\n\n\t tabs, 1234567 numbers and 'quotes' don't"
)
MESSAGES = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "你好, what is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "def f(): pass"},
]
# (checkpoint maker, sentencepiece vocabulary, gpt2 pre-tokenizer name)
CASES: dict[str, tuple[Any, bool, str | None]] = {
    "llama_sentencepiece": (make_llama_checkpoint, True, None),
    "llama3_byte_level": (make_llama_checkpoint, False, "llama-bpe"),
    "qwen2_byte_level": (make_qwen2_checkpoint, False, "qwen2"),
    "gpt2_default_split": (make_qwen2_checkpoint, False, "gpt2"),
}


@pytest.fixture(scope="module", params=list(CASES))
def gguf_file(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    make, spm, pre = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    checkpoint = make(root / "ck")
    return write_gguf(checkpoint, root / "gguf" / "model.gguf", sentencepiece=spm, pre=pre)


def hf_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def test_token_ids_equal_transformers_gguf_conversion(gguf_file: Path) -> None:
    ours, ref = tokenizer_from_gguf(open_gguf(gguf_file)), hf_tokenizer(gguf_file)
    for text in (TEXT, " leading space", "<s>inline special</s>", "<|im_start|>user\nhi<|im_end|>"):
        assert ours.encode(text) == ref.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False), text
    ids = ours.encode(TEXT, add_special_tokens=False)
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids) == TEXT


def test_chat_template_renders_identically(gguf_file: Path) -> None:
    ours, ref = tokenizer_from_gguf(open_gguf(gguf_file)), hf_tokenizer(gguf_file)
    for prompt in (True, False):
        expected = ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=prompt)
        assert ours.apply_chat_template(MESSAGES, add_generation_prompt=prompt) == expected


def test_special_ids_come_from_the_metadata(gguf_file: Path) -> None:
    model = open_gguf(gguf_file)
    tok, meta = tokenizer_from_gguf(model), model.metadata
    assert tok.eos_token_id == meta["tokenizer.ggml.eos_token_id"]
    assert tok.bos_token_id == meta.get("tokenizer.ggml.bos_token_id")
    assert tok.vocab_size == len(meta["tokenizer.ggml.tokens"])


def test_tokenizer_override_replaces_the_metadata_vocabulary(tmp_path: Path) -> None:
    checkpoint = make_qwen2_checkpoint(tmp_path / "ck")
    path = write_gguf(checkpoint, tmp_path / "gguf" / "model.gguf")
    override = load_tokenizer(str(checkpoint), path, open_gguf(path))
    embedded = load_tokenizer(None, path, open_gguf(path))
    assert override.tokenizer_digest() != embedded.tokenizer_digest()
    # the checkpoint's tokenizer.json uses GPT-2's split, the file's "qwen2" split differs on digits
    assert override.encode("1234") != embedded.encode("1234")


def test_sentencepiece_merges_follow_scores_then_longer_left_piece() -> None:
    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    scores = [0.0, 0.0, 0.0, -1.0, -2.0, -0.5]
    assert merges_from_scores(tokens, scores) == [("ab", "c"), ("a", "bc"), ("a", "b"), ("b", "c")]
