"""Structured output with llguidance: grammars compiled off the engine step, masks per decode step.

`GrammarCompiler` turns a `StructuredOutputSpec` into an llguidance grammar on a worker thread
(the server awaits that future before it adds the request, so a slow schema never stalls the
engine loop) and caches the result by spec (LRU). Each request gets its own `LLMatcher` (a copy
of the cached one), which `fill_bitmask` reads to build the batch's token bitmask and `advance`
moves on by each sampled token.

llguidance (the Rust grammar engine of Guidance, also a vLLM backend) was chosen over xgrammar:
it installs as one wheel with no Python dependencies, while xgrammar pulls triton here.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from kvpager.core.sampling_params import StructuredOutputSpec

logger = logging.getLogger("kvpager")

CACHE_SIZE = 256
# JSON without free whitespace: a small model cannot wander off into endless blanks.
JSON_OPTIONS: Any = {"whitespace_flexible": False}


@dataclass(frozen=True)
class CompiledGrammar:
    """A grammar that compiled: new requests copy `template` (an LLMatcher in its start state)."""

    template: Any

    def new_matcher(self) -> Any:
        return self.template.deep_copy()


def grammar_text(spec: StructuredOutputSpec) -> str:
    """The llguidance grammar of a spec (ValueError naming the problem when it is malformed)."""
    import llguidance

    if spec.kind == "json_object":
        return str(llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS))
    if spec.kind == "json":
        return str(llguidance.LLMatcher.grammar_from_json_schema(spec.spec, defaults=JSON_OPTIONS))
    if spec.kind == "regex":
        return str(llguidance.LLMatcher.grammar_from_regex(spec.spec))
    if spec.kind == "choice":
        choices = json.loads(spec.spec)
        return str(llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices)))
    return str(llguidance.grammar_from("grammar", spec.spec))  # Lark or GBNF


class GrammarCompiler:
    """Compiles and caches grammars for one tokenizer; thread-safe."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self._tokenizer_json = tokenizer_json
        self._eos = list(eos_token_ids)
        self._tokenizer: Any = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[StructuredOutputSpec, Future[CompiledGrammar]] = OrderedDict()
        self._executor: ThreadPoolExecutor | None = None

    def compile(self, spec: StructuredOutputSpec) -> Future[CompiledGrammar]:
        """The (cached) compilation of `spec`, running on the compiler thread; its error is a ValueError."""
        with self._lock:
            future = self._cache.get(spec)
            if future is not None:
                self._cache.move_to_end(spec)
                return future
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpager-grammar")
            future = self._executor.submit(self._compile, spec)
            self._cache[spec] = future
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            return future

    def matcher(self, spec: StructuredOutputSpec) -> Any:
        """A fresh matcher for one request (blocks until the grammar is compiled)."""
        return self.compile(spec).result().new_matcher()

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    def _llg_tokenizer(self) -> Any:
        import llguidance

        if self._tokenizer is None:  # NOTE: only the compiler thread builds it (~1 s for a large vocab)
            eos: int | list[int] | None = self._eos or None
            self._tokenizer = llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size, eos_token=eos)
        return self._tokenizer

    def _compile(self, spec: StructuredOutputSpec) -> CompiledGrammar:
        import llguidance

        try:
            grammar = grammar_text(spec)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"invalid {spec.kind} constraint: {exc}") from exc
        tokenizer = self._llg_tokenizer()
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        if error and not error.startswith("WARNING"):
            raise ValueError(f"invalid {spec.kind} constraint: {error}")
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid {spec.kind} constraint: {matcher.get_error()}")
        return CompiledGrammar(matcher)


def fill_bitmask(matchers: Sequence[Any], vocab_size: int) -> torch.Tensor:
    """[len(matchers), ceil(V/32)] int32: the tokens each matcher allows next."""
    words = (vocab_size + 31) // 32
    bitmask = torch.full((len(matchers), words), -1, dtype=torch.int32)
    for i, matcher in enumerate(matchers):
        row = bitmask[i]
        matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
    return bitmask


def batch_bitmask(matchers: Sequence[Any], vocab_size: int) -> tuple[torch.Tensor | None, list[int]]:
    """(bitmask of the rows that have a matcher, those rows' indices); (None, []) when none has."""
    guided = [i for i, m in enumerate(matchers) if m is not None]
    if not guided:
        return None, []
    return fill_bitmask([matchers[i] for i in guided], vocab_size), guided


def advance(matcher: Any, token_id: int) -> None:
    """Feed the sampled token to the request's matcher (a rejected token is logged, not raised)."""
    if matcher.is_stopped():
        return
    if not matcher.consume_token(token_id) and matcher.is_error():
        logger.warning("grammar rejected token %d: %s", token_id, matcher.get_error())
