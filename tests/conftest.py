"""Shared fixtures: one torch thread, session-scoped tiny random checkpoints (see checkpoints.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoints import make_llama_checkpoint, make_mistral_checkpoint, make_qwen2_checkpoint, make_qwen3_checkpoint

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def llama_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny LlamaForCausalLM: hidden 64, 2 layers, 4 heads / 2 KV heads, vocab 384, with tokenizer."""
    return make_llama_checkpoint(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="session")
def qwen2_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Qwen2ForCausalLM: q/k/v bias, tied embeddings, ChatML template."""
    return make_qwen2_checkpoint(tmp_path_factory.mktemp("qwen2"), seed=1)


@pytest.fixture(scope="session")
def qwen3_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Qwen3ForCausalLM: per-head q/k norm, head_dim 32."""
    return make_qwen3_checkpoint(tmp_path_factory.mktemp("qwen3"), seed=2)


@pytest.fixture(scope="session")
def mistral_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny MistralForCausalLM (sliding window 4096, never reached)."""
    return make_mistral_checkpoint(tmp_path_factory.mktemp("mistral"), seed=3)
