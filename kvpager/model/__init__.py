"""Llama-family models over a paged KV cache.

Public API (docs/internals.md):
    load_model(model_dir, dtype=..., device=..., load_format="auto") -> CausalLM
    load_model_spec(model_dir) -> ModelSpec                      (torch-free, from spec.py)
    allocate_kv_cache(spec, num_blocks, block_size, dtype, device) -> tensor
    build_attention_metadata(query_lens, seq_lens, block_tables, block_size, device) -> AttentionMetadata

NOTE: the torch-backed names are imported lazily, so `import kvpager.model.spec` (the planner, the
scheduler, the CLI) never imports torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from kvpager.model.spec import SUPPORTED_ARCHITECTURES, ModelFileNotFoundError, ModelSpec, load_model_spec

_LAZY = {
    "AttentionMetadata": "kvpager.model.attention",
    "allocate_kv_cache": "kvpager.model.attention",
    "build_attention_metadata": "kvpager.model.attention",
    "CausalLM": "kvpager.model.llama",
    "load_model": "kvpager.model.loader",
}

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelFileNotFoundError", "ModelSpec", "load_model_spec", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvpager.model' has no attribute {name!r}")
