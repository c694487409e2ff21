"""A GGUF model's tokenizer, rebuilt from its metadata as a `tokenizers` tokenizer. Torch-free.

A GGUF file carries no tokenizer.json; llama.cpp's converter stores the vocabulary under
`tokenizer.ggml.*`: `model` ("gpt2": byte-level BPE with `merges`; "llama": SentencePiece-style BPE
with byte fallback and per-token `scores`), `tokens`, `token_type` (3 control, 4 user-defined, 6 byte),
the bos/eos/unk/pad ids, `add_bos_token`, `add_space_prefix` and `pre` (the name of the pre-tokenizer
split: the regex the merges were learned with). `tokenizer.chat_template` is the chat template.

A SentencePiece vocabulary has no merges in the file: they are derived from the scores (a pair
merges at the priority of the token it makes, ties to the longer left piece), which is how
SentencePiece's BPE picks merges and how transformers converts these files.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from kvpager.gguf.reader import GGUFError, GGUFModel
from kvpager.text.tokenizer import Tokenizer

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
SPIECE_SPACE = "\u2581"

# Pre-tokenizer splits by llama.cpp's `tokenizer.ggml.pre` name (the regexes of the models' own
# tokenizer.json files). "gpt2"/"default" use byte-level's built-in GPT-2 split.
_LLAMA3_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS: dict[str, str | None] = {
    "default": None,
    "gpt2": None,
    "gpt-2": None,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}


def tokenizer_from_gguf(model: GGUFModel) -> Tokenizer:
    """The kvpager Tokenizer for a GGUF model's embedded vocabulary; GGUFError naming what is unsupported."""
    meta = model.metadata
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise GGUFError(f"GGUF file {str(model.path)!r} has no tokenizer.ggml.tokens; pass --tokenizer DIR")
    kind = meta.get("tokenizer.ggml.model")
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if kind == "gpt2":
        hf = _byte_level(model, tokens)
    elif kind == "llama":
        hf = _sentencepiece(model, tokens)
    else:
        raise GGUFError(
            f"GGUF file {str(model.path)!r}: tokenizer.ggml.model {kind!r} is not supported (gpt2, llama); pass --tokenizer DIR"
        )
    _add_special_tokens(hf, tokens, types)
    config = _tokenizer_config(meta, tokens, kind)
    template = meta.get("tokenizer.chat_template")
    chat_template = template if isinstance(template, str) else None
    extra_eos = [meta.get(f"tokenizer.ggml.{key}_token_id") for key in ("eot", "eom")]
    serialized = json.dumps([hf.to_str(), config, chat_template], sort_keys=True)
    return Tokenizer(
        hf,
        config,
        chat_template=chat_template,
        generation_eos_ids=[int(i) for i in extra_eos if i is not None],
        digest=hashlib.sha256(serialized.encode("utf-8")).hexdigest(),
    )


def _byte_level(model: GGUFModel, tokens: list[str]) -> HFTokenizer:
    merges = model.metadata.get("tokenizer.ggml.merges")
    if not isinstance(merges, list):
        raise GGUFError(f"GGUF file {str(model.path)!r}: a gpt2 tokenizer needs tokenizer.ggml.merges")
    vocab = {token: index for index, token in enumerate(tokens)}
    pairs = [_split_merge(m, model) for m in merges]
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    pre = model.metadata.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZER_SPLITS:
        known = ", ".join(sorted(PRE_TOKENIZER_SPLITS))
        raise GGUFError(
            f"GGUF file {str(model.path)!r}: pre-tokenizer {pre!r} is not known (known: {known}); pass --tokenizer DIR"
        )
    split = PRE_TOKENIZER_SPLITS[pre]
    if split is None:
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    hf.decoder = decoders.ByteLevel()
    return hf


def _sentencepiece(model: GGUFModel, tokens: list[str]) -> HFTokenizer:
    meta = model.metadata
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = meta.get("tokenizer.ggml.merges")
    if isinstance(merges, list):
        pairs = [_split_merge(m, model) for m in merges]
    else:
        scores = meta.get("tokenizer.ggml.scores")
        if not isinstance(scores, list) or len(scores) != len(tokens):
            raise GGUFError(f"GGUF file {str(model.path)!r}: a llama tokenizer needs tokenizer.ggml.scores or merges")
        pairs = merges_from_scores(tokens, [float(s) for s in scores])
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, unk_token=unk, fuse_unk=True, byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    hf.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=SPIECE_SPACE, prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    hf.decoder = decoders.Sequence(steps)
    return hf


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into two vocabulary
    pieces, ranked by the token's score (higher first), then the longer left piece, then file order."""
    vocab = set(tokens)
    ranked: list[tuple[float, int, int, int, str, str]] = []
    for index, (token, score) in enumerate(zip(tokens, scores, strict=True)):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, -len(left), -len(right), index, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _split_merge(merge: Any, model: GGUFModel) -> tuple[str, str]:
    parts = merge.split(" ") if isinstance(merge, str) else []
    if len(parts) != 2:
        raise GGUFError(f"GGUF file {str(model.path)!r}: tokenizer.ggml.merges entry {merge!r} is not 'left right'")
    return parts[0], parts[1]


def _add_special_tokens(hf: HFTokenizer, tokens: list[str], types: list[int]) -> None:
    """Control tokens match whole and are special; user-defined ones match whole and are plain text."""
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, k in zip(tokens, types, strict=False)
        if k == TOKEN_TYPE_CONTROL
    ]
    user = [
        AddedToken(t, normalized=False, special=False)
        for t, k in zip(tokens, types, strict=False)
        if k == TOKEN_TYPE_USER_DEFINED
    ]
    if control:
        hf.add_special_tokens(control)
    if user:
        hf.add_tokens(user)


def _tokenizer_config(meta: dict[str, Any], tokens: list[str], kind: str) -> dict[str, Any]:
    """tokenizer_config.json's fields: the special tokens by text and add_bos_token."""

    def token(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None

    # NOTE: llama.cpp adds BOS for a SentencePiece vocabulary unless the file says otherwise.
    add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama")
    return {
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "add_bos_token": bool(add_bos),
    }
