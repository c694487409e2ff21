"""Model facts: what the planner needs from a model's config.json, parsed once into a frozen record.

The shipped well-known models (`data/models.json`) go through the same parser as a user's config.json,
so a shipped fact is exactly what the published config says.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

from kvpager.gguf import hf_config_from_gguf, is_gguf_path, open_gguf

REQUIRED_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size")
_QWEN_FAMILY = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
_GEMMA3 = ("gemma3", "gemma3_text")
# transformers' per-architecture default for a config.json without `tie_word_embeddings`: these
# families' config classes default to False; PretrainedConfig (and so Gemma, Phi...) to True.
_UNTIED_BY_DEFAULT = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "deepseek_v3")


@dataclass(frozen=True)
class MLAFacts:
    """Multi-head latent attention (DeepSeek-V2/V3): the cache holds one latent per layer per token."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class MoEFacts:
    """Mixture of experts: which layers are sparse and how big their experts are."""

    num_experts: int
    num_experts_per_tok: int
    expert_intermediate_size: int
    shared_intermediate_size: int  # all shared experts together; 0 when there are none
    dense_layers: frozenset[int]  # layers that keep a dense MLP of `intermediate_size`
    router_bias: bool  # DeepSeek-V3's e_score_correction_bias


@dataclass(frozen=True)
class ModelFacts:
    """Everything the planner reads from a config; derived numbers live in params.py and kvmath.py."""

    name: str
    source: str
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int | None
    attention_bias: bool
    qk_norm: bool
    norms_per_layer: int
    layer_windows: tuple[int | None, ...]  # per layer: sliding window in tokens, None = full attention
    mla: MLAFacts | None = None
    moe: MoEFacts | None = None
    published_parameters: int | None = None
    published_parameters_source: str | None = None


def facts_from_config(config: dict[str, Any], *, name: str, source: str) -> ModelFacts:
    """Parse a Hugging Face config.json dict. ValueError naming the missing or bad field."""
    cfg = _flatten_text_config(config)
    missing = [f for f in REQUIRED_FIELDS if not isinstance(cfg.get(f), int)]
    if missing:
        raise ValueError(
            f"{source}: config is missing integer field(s) {', '.join(missing)}; is this a decoder LLM config.json?"
        )
    model_type = str(cfg.get("model_type", "unknown"))
    heads = cfg["num_attention_heads"]
    num_kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    for field, value in (
        ("num_hidden_layers", cfg["num_hidden_layers"]),
        ("num_attention_heads", heads),
        ("num_key_value_heads", num_kv_heads),
        ("head_dim", head_dim),
    ):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{source}: {field} must be a positive integer, got {value!r}")
    return ModelFacts(
        name=name,
        source=source,
        model_type=model_type,
        hidden_size=cfg["hidden_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", model_type not in _UNTIED_BY_DEFAULT)),
        max_position_embeddings=cfg.get("max_position_embeddings"),
        attention_bias=model_type == "qwen2" or model_type == "qwen2_moe" or bool(cfg.get("attention_bias", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe") or model_type in _GEMMA3,
        norms_per_layer=4 if model_type in ("gemma2", *_GEMMA3) else 2,
        layer_windows=_layer_windows(cfg, model_type),
        mla=_mla(cfg),
        moe=_moe(cfg, model_type),
    )


def _flatten_text_config(config: dict[str, Any]) -> dict[str, Any]:
    """Multimodal checkpoints (Gemma-3, Llava) keep the language model's fields under `text_config`."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        return config
    merged = {k: v for k, v in config.items() if k != "text_config"}
    merged.update(text)
    return merged


def _layer_windows(cfg: dict[str, Any], model_type: str) -> tuple[int | None, ...]:
    num_layers: int = cfg["num_hidden_layers"]
    window = cfg.get("sliding_window")
    if not window:
        return (None,) * num_layers
    if isinstance(cfg.get("layer_types"), list):
        return tuple(window if t == "sliding_attention" else None for t in cfg["layer_types"])
    if model_type in _QWEN_FAMILY:
        # Qwen: windowed only when use_sliding_window, and then only layers >= max_window_layers.
        if not cfg.get("use_sliding_window", False):
            return (None,) * num_layers
        first = cfg.get("max_window_layers", num_layers)
        return tuple(window if i >= first else None for i in range(num_layers))
    if model_type == "gemma2":
        return tuple(window if i % 2 == 0 else None for i in range(num_layers))
    if model_type in _GEMMA3:
        pattern = cfg.get("sliding_window_pattern", 6)
        return tuple(window if (i + 1) % pattern else None for i in range(num_layers))
    return (window,) * num_layers  # Mistral v0.1, Phi-3: every layer


def _mla(cfg: dict[str, Any]) -> MLAFacts | None:
    if not cfg.get("kv_lora_rank"):
        return None
    return MLAFacts(
        q_lora_rank=cfg.get("q_lora_rank"),
        kv_lora_rank=cfg["kv_lora_rank"],
        qk_nope_head_dim=cfg["qk_nope_head_dim"],
        qk_rope_head_dim=cfg["qk_rope_head_dim"],
        v_head_dim=cfg["v_head_dim"],
    )


def _moe(cfg: dict[str, Any], model_type: str) -> MoEFacts | None:
    num_layers: int = cfg["num_hidden_layers"]
    if cfg.get("n_routed_experts"):  # DeepSeek-V2/V3
        freq = cfg.get("moe_layer_freq", 1)
        first_dense = cfg.get("first_k_dense_replace", 0)
        dense = frozenset(i for i in range(num_layers) if i < first_dense or i % freq != 0)
        shared = (cfg.get("n_shared_experts") or 0) * cfg["moe_intermediate_size"]
        return MoEFacts(
            cfg["n_routed_experts"],
            cfg["num_experts_per_tok"],
            cfg["moe_intermediate_size"],
            shared,
            dense,
            model_type == "deepseek_v3",
        )
    if cfg.get("num_local_experts"):  # Mixtral: every layer sparse, experts of intermediate_size
        return MoEFacts(
            cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["intermediate_size"], 0, frozenset(), False
        )
    if cfg.get("num_experts") and cfg.get("moe_intermediate_size"):  # Qwen2-MoE / Qwen3-MoE
        step = cfg.get("decoder_sparse_step", 1) or 1
        mlp_only = set(cfg.get("mlp_only_layers") or [])
        dense = frozenset(i for i in range(num_layers) if i in mlp_only or (i + 1) % step != 0)
        shared = cfg.get("shared_expert_intermediate_size") or 0
        return MoEFacts(
            cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"], shared, dense, False
        )
    return None


# --- shipped well-known models -------------------------------------------------------------------


def shipped_model_entries() -> list[dict[str, Any]]:
    """The raw entries of data/models.json (config fields, source, published parameter counts)."""
    text = resources.files("kvpager.planner").joinpath("data/models.json").read_text(encoding="utf-8")
    entries: list[dict[str, Any]] = json.loads(text)["models"]
    return entries


def shipped_model_names() -> list[str]:
    return [e["name"] for e in shipped_model_entries()]


def facts_from_entry(entry: dict[str, Any]) -> ModelFacts:
    facts = facts_from_config(entry["config"], name=entry["name"], source=entry["source"])
    return replace(
        facts,
        published_parameters=entry["published_parameters"],
        published_parameters_source=entry["published_parameters_source"],
    )


def find_shipped(name: str) -> dict[str, Any] | None:
    """Case-insensitive lookup by name, alias or Hugging Face repo id."""
    key = name.strip().lower()
    for entry in shipped_model_entries():
        keys = {entry["name"].lower(), entry["repo"].lower(), entry["repo"].split("/")[-1].lower()}
        keys.update(a.lower() for a in entry.get("aliases", []))
        if key in keys:
            return entry
    return None


def load_model_facts(model: str) -> ModelFacts:
    """MODEL is a model directory, a config.json path, a GGUF model (file, split part or directory holding
    one) or a shipped model name (ValueError otherwise)."""
    path = Path(model).expanduser()
    if is_gguf_path(path):
        gguf_model = open_gguf(path)
        return facts_from_config(
            hf_config_from_gguf(gguf_model), name=gguf_model.path.stem, source=str(gguf_model.path)
        )
    if path.is_dir():
        return _facts_from_file(path / "config.json", name=path.name)
    if path.is_file():
        return _facts_from_file(path, name=path.parent.name or path.stem)
    entry = find_shipped(model)
    if entry is not None:
        return facts_from_entry(entry)
    raise ValueError(_unknown_model_message(model))


def _facts_from_file(path: Path, *, name: str) -> ModelFacts:
    if not path.is_file():
        raise ValueError(
            f"{path.parent} has no config.json: pass a Hugging Face model directory, a config.json or a known model name"
        )
    return facts_from_config(read_config_json(path), name=name, source=str(path))


def read_config_json(path: Path) -> dict[str, Any]:
    """Load a config.json object; ValueError naming the file when unreadable, malformed or not an object."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{str(path)!r} is not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{str(path)!r} must hold a JSON object (a Hugging Face config), got {type(config).__name__}")
    return config


def _unknown_model_message(model: str) -> str:
    names = shipped_model_names()
    lowered = {n.lower(): n for n in names}
    close = [lowered[c] for c in difflib.get_close_matches(model.lower(), list(lowered), n=3, cutoff=0.5)]
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    return f"unknown model {model!r}: not a directory, not a config.json, and not a known model name.{hint} Known models: {', '.join(names)}."
