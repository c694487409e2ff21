"""ModelSpec: the torch-free description of a Llama-family checkpoint, parsed from config.json.

The planner, the scheduler and the CLI read it without importing torch; the loader builds the
model from it. Both the legacy config keys (`rope_theta` + `rope_scaling`) and transformers 5's
`rope_parameters` are understood.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpager.core.sizing import KVShape
from kvpager.gguf import GGUFModel, hf_config_from_gguf, is_gguf_path, open_gguf
from kvpager.planner.models import facts_from_config, read_config_json


@dataclass(frozen=True)
class _ArchRules:
    """How an architecture reads config.json (as transformers' modeling code does)."""

    qk_norm: bool
    qkv_bias: bool | None  # None: config's attention_bias
    o_proj_bias: bool | None  # None: config's attention_bias
    mlp_bias_from_config: bool


SUPPORTED_ARCHITECTURES: dict[str, _ArchRules] = {
    "LlamaForCausalLM": _ArchRules(qk_norm=False, qkv_bias=None, o_proj_bias=None, mlp_bias_from_config=True),
    "MistralForCausalLM": _ArchRules(qk_norm=False, qkv_bias=False, o_proj_bias=False, mlp_bias_from_config=False),
    "Qwen2ForCausalLM": _ArchRules(qk_norm=False, qkv_bias=True, o_proj_bias=False, mlp_bias_from_config=False),
    "Qwen3ForCausalLM": _ArchRules(qk_norm=True, qkv_bias=None, o_proj_bias=None, mlp_bias_from_config=False),
}

# RoPE types the model implements. NOTE: "dynamic" (NTK) only changes the frequencies beyond
# max_position_embeddings, and positions never go beyond it here, so it equals "default".
# "freq_factors": one divisor per frequency given as a list ("factors"), how GGUF files store Llama 3's.
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "freq_factors")


class ModelFileNotFoundError(FileNotFoundError, ValueError):
    """A model directory or one of its files is missing (catchable as ValueError too)."""


@dataclass(frozen=True)
class ModelSpec:
    """Shape and hyper-parameters of a Llama-family decoder.

    `sliding_window` is None when every layer attends to the whole context. When set, every layer
    uses the window (Mistral v0.1 style); attention masks keys older than `sliding_window`
    positions. `attention_bias` is the q/k/v projections' bias, `o_proj_bias` the output's (Qwen2
    has the first only). `rope_scaling` holds the scaling parameters (with "rope_type") or None for plain RoPE.
    """

    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    mlp_bias: bool = False
    o_proj_bias: bool = False

    def __post_init__(self) -> None:
        _check(
            self.num_heads % self.num_kv_heads == 0,
            f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads ({self.num_kv_heads})",
        )
        _check(self.head_dim % 2 == 0, f"head_dim must be even for RoPE, got {self.head_dim}")
        rope_type = self.rope_type
        _check(
            rope_type in SUPPORTED_ROPE_TYPES,
            f"unsupported rope_scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}",
        )

    @property
    def rope_type(self) -> str:
        """The RoPE variant ("default" when there is no scaling)."""
        if self.rope_scaling is None:
            return "default"
        return str(self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default")))

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_shape(self, dtype_bytes: int) -> KVShape:
        """What one token position costs in the paged KV pool at `dtype_bytes` per element."""
        return KVShape(
            num_layers=self.num_layers, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype_bytes=dtype_bytes
        )

    def num_parameters(self) -> int:
        """Parameter count as stored (embedding and lm_head counted once when tied)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        attn += (self.q_size + 2 * self.kv_size) if self.attention_bias else 0
        attn += h if self.o_proj_bias else 0
        attn += 2 * self.head_dim if self.qk_norm else 0
        mlp = 3 * h * i + ((2 * i + h) if self.mlp_bias else 0)
        per_layer = attn + mlp + 2 * h
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_layers * per_layer + h + head

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], generation_config: dict[str, Any] | None = None) -> ModelSpec:
        """Parse a Hugging Face config.json dict (and optionally generation_config.json for EOS ids).

        NOTE: narrowed from the planner's parse (`facts_from_config`), so the planner and the engine
        read the same shapes from the same file; this adds what only the engine needs (biases,
        RoPE, EOS) and refuses what it cannot run.
        """
        arch = _architecture(config)
        rules = SUPPORTED_ARCHITECTURES[arch]
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
            _required(config, key)
        facts = facts_from_config(config, name=arch, source="config.json")
        config_bias = bool(config.get("attention_bias", False))
        act = config.get("hidden_act", "silu")
        _check(act in ("silu", "swish"), f"{arch}: hidden_act {act!r} is not supported (only silu)")
        rope_theta, rope_scaling = _rope(config)
        eos = _ids(config.get("eos_token_id")) + _ids((generation_config or {}).get("eos_token_id"))
        return cls(
            architecture=arch,
            hidden_size=facts.hidden_size,
            num_layers=facts.num_layers,
            num_heads=facts.num_heads,
            num_kv_heads=facts.num_kv_heads,
            head_dim=facts.head_dim,
            intermediate_size=facts.intermediate_size,
            vocab_size=facts.vocab_size,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(facts.max_position_embeddings or 2048),
            tie_word_embeddings=facts.tie_word_embeddings,
            attention_bias=config_bias if rules.qkv_bias is None else rules.qkv_bias,
            qk_norm=rules.qk_norm,
            sliding_window=_sliding_window(arch, facts.layer_windows),
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(eos)),
            torch_dtype=str(config.get("torch_dtype") or config.get("dtype") or "float32"),
            mlp_bias=rules.mlp_bias_from_config and bool(config.get("mlp_bias", False)),
            o_proj_bias=config_bias if rules.o_proj_bias is None else rules.o_proj_bias,
        )


def load_model_spec(model_dir: str | Path) -> ModelSpec:
    """Read `model_dir/config.json` (+ generation_config.json when present) into a ModelSpec.

    A GGUF model (a .gguf file, or a directory holding one and no config.json) is read from its metadata.
    """
    root = Path(model_dir)
    if is_gguf_path(root):
        return spec_from_gguf(open_gguf(root))
    if not root.is_dir():
        raise ModelFileNotFoundError(f"model directory {str(root)!r} does not exist or is not a directory")
    config = read_json(root / "config.json")
    gen_path = root / "generation_config.json"
    generation = read_json(gen_path) if gen_path.is_file() else None
    return ModelSpec.from_hf_config(config, generation)


def spec_from_gguf(model: GGUFModel) -> ModelSpec:
    """The ModelSpec of an opened GGUF model (its metadata mapped onto a config.json dict)."""
    return ModelSpec.from_hf_config(hf_config_from_gguf(model))


def read_json(path: Path) -> dict[str, Any]:
    """Load a JSON object from `path`; ValueError naming the file when missing or malformed."""
    if not path.is_file():
        raise ModelFileNotFoundError(f"{str(path)!r} not found: a Hugging Face model directory needs it")
    return read_config_json(path)


def _architecture(config: dict[str, Any]) -> str:
    archs = config.get("architectures") or []
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    if not archs:
        raise ValueError(f"config.json has no 'architectures' entry; supported architectures: {supported}")
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return str(arch)
    raise ValueError(f"unsupported architecture {archs[0]!r}; supported architectures: {supported}")


def _rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from either rope_parameters (transformers 5) or the legacy keys."""
    params = dict(config.get("rope_parameters") or {})
    legacy = config.get("rope_scaling")
    if legacy:
        params = {**dict(legacy), **params}
    theta = float(params.pop("rope_theta", None) or config.get("rope_theta") or 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    params["rope_type"] = rope_type
    params.pop("type", None)
    if rope_type == "llama3":
        params.setdefault("original_max_position_embeddings", config.get("max_position_embeddings", 2048))
    return theta, params


def _sliding_window(arch: str, layer_windows: tuple[int | None, ...]) -> int | None:
    """The window every layer uses, or None. Sliding on only some layers (Qwen, Gemma) is refused."""
    windows = set(layer_windows)
    if windows == {None}:
        return None
    # NOTE: per-layer masks (some layers sliding, some full) are not implemented.
    _check(
        len(windows) == 1,
        f"{arch}: sliding window on only some layers is not supported (windows per layer: {sorted(windows, key=str)})",
    )
    window = windows.pop()
    assert window is not None
    return int(window)


def _required(config: dict[str, Any], key: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"config.json: {key!r} must be a positive integer, got {value!r}")
    return value


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
