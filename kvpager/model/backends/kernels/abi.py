"""The one declaration of every C kernel: parameters in C order, checked on each call (binding.py).

build.py generates the C prototypes (`kvp_abi.h`, included by common.h) from these specs, so the
compiler rejects a C++ definition whose parameter types differ. Symbols name sizes: the first tensor
that has a symbol binds it, every other use must agree, and an `Int` parameter derived from a symbol
receives it (the caller never passes sizes or strides). The layouts are documented in common.h.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from kvpager.model.backends.kernels.binding import Float, Int, KernelSpec, Tensor

F32 = (torch.float32,)
I64 = (torch.int64,)
BF16 = (torch.bfloat16,)
KV = (torch.float32, torch.bfloat16, torch.float16)  # KV cache elements; "kv" binds their element size
# kv_format: how the kernels read the KV cache's elements (kKvFloat32 / kKvBfloat16 / kKvFloat16 in common.h)
KV_FORMATS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
LAYER_TABLE_WIDTH = 16  # kLayerTableWidth in common.h
LAYER_TABLE_ADDRESSES = 12  # addresses per layer; then the four weights' layouts (< 0: a packed 16-bit weight)
PARTS_LAYOUT = -1024  # a quantized weight's layout code: multiplied part by part (kPartsLayout in common.h)
# kvp_decode_layers' weight_parts [L, 4, MAX_PARTS, PART_WIDTH]: per row part of a weight (kind, codes,
# scales, offsets, format value, group, rows, 0); kinds PART_DOT (kvq_dot_linear) and PART_PACKED
# (kvq_linear), 0 after the last part (kMaxParts, kPartWidth, kPartDot, kPartPacked in common.h)
MAX_PARTS = 3
PART_WIDTH = 8
PART_DOT, PART_PACKED = 1, 2


def _parts_fit(t: Mapping[str, torch.Tensor], s: Mapping[str, int]) -> bool:
    """weight_parts describes each PARTS_LAYOUT weight (the kernel reads no other weight's parts): a
    first part, then parts of known kinds with no gap, positive row counts adding up to its output width
    (q/k/v, o, gate/up, down)."""
    quantized = t["layers"][:, LAYER_TABLE_ADDRESSES:] == PARTS_LAYOUT  # [L, 4]
    if not bool(quantized.any()):
        return True
    parts = t["weight_parts"]
    kinds, rows = parts[..., 0], parts[..., 6]  # [L, 4, MAX_PARTS]
    present = kinds != 0
    qkv = (s["num_heads"] + 2 * s["num_kv_heads"]) * s["head_dim"]
    widths = torch.tensor([qkv, s["H"], 2 * s["inter"], s["H"]])
    bad = (kinds < 0) | (kinds > PART_PACKED) | ((rows > 0) != present)  # unknown kinds, rows of absent parts
    bad[..., 1:] |= present[..., 1:] & ~present[..., :-1]  # a part after an absent one
    fits = ~bad.any(-1) & present[..., 0] & ((rows * present).sum(-1) == widths)  # [L, 4]
    return bool((fits | ~quantized).all())


def _part_kinds(t: Mapping[str, torch.Tensor]) -> set[int]:
    """The kinds of part the PARTS_LAYOUT weights use (none when the table has no such weight)."""
    if PARTS_LAYOUT not in _layout_codes(t):
        return set()
    kinds: list[int] = t["weight_parts"][..., 0].unique().tolist()
    return set(kinds)


def decode_layers_scratch(s: Mapping[str, int]) -> int:
    """The floats kvp_decode_layers' scratch holds for M rows (sizes as named in its spec): q/k/v,
    attention, gate/up, the activation and a normed row, then one row part's output."""
    q, kv, inter, hidden = s["num_heads"] * s["head_dim"], s["num_kv_heads"] * s["head_dim"], s["inter"], s["H"]
    return s["M"] * (2 * q + 2 * kv + 3 * inter + hidden + max(q + 2 * kv, 2 * inter, hidden))


def _layout_codes(t: Mapping[str, torch.Tensor]) -> list[int]:
    """kvp_decode_layers' weight layout codes, as Python ints (one tensor op per call)."""
    codes: list[int] = t["layers"][:, LAYER_TABLE_ADDRESSES:].flatten().tolist()
    return codes


Sym = Mapping[str, int]


def _kv_format_check(cache: str) -> tuple[str, Callable[[Mapping[str, torch.dtype], Sym], bool]]:
    """kv_format (the caller's) names the dtype of the `cache` tensor: the kernel reads its elements so."""
    return (
        f"kv_format is the {cache} tensor's dtype (0 float32, 1 bfloat16, 2 float16)",
        lambda dtypes, s: KV_FORMATS[dtypes[cache]] == s["kv_format"],
    )


def _slots(s: Sym) -> int:
    return s["num_blocks"] * s["block_size"]


def _context(s: Sym) -> int:
    """One past the longest context a block table row holds."""
    return s["max_blocks"] * s["block_size"] + 1


def _zero(s: Sym) -> int:
    return 0


def _one(s: Sym) -> int:
    return 1


def _cache(writes: bool = False) -> Tensor:
    return Tensor(KV, ("num_blocks", "block_size", "num_kv_heads", "head_dim"), writes=writes, dtype_as="kv")


_GQA = (
    "num_heads is a multiple of num_kv_heads",
    lambda s: s["num_kv_heads"] > 0 and s["num_heads"] % s["num_kv_heads"] == 0,
)
_HALF = ("cos/sin hold head_dim / 2 values per token", lambda s: s["head_dim"] == 2 * s["half"])
_PARTITION = ("partition >= 1 and window >= 0", lambda s: s["partition"] >= 1 and s["window"] >= 0)

_ATTENTION_Q = (
    ("q", Tensor(F32, ("q_rows", "num_heads", "head_dim"), row_stride="q_stride")),
    ("q_stride", Int("q_stride")),
    ("out", Tensor(F32, ("q_rows", "num_heads", "head_dim"), writes=True, row_stride="out_stride")),
    ("out_stride", Int("out_stride")),
)


def _silu_mul_spec(name: str, dtype: tuple[torch.dtype, ...]) -> KernelSpec:
    """SwiGLU over rows of `dtype`: out [rows, inter] = silu(gate) * up of gate_up [rows, 2 inter]."""
    return KernelSpec(
        name,
        (
            ("gate_up", Tensor(dtype, ("rows", "width"))),
            ("out", Tensor(dtype, ("rows", "inter"), writes=True)),
            ("rows", Int("rows")),
            ("inter", Int("inter")),
        ),
        checks=(("gate_up is twice as wide as out", lambda s: s["width"] == 2 * s["inter"]),),
    )


def _rope_spec(name: str, qkv: Tensor, q_out: Tensor | None = None) -> KernelSpec:
    """kvp_rope_and_cache (in place on a float32 qkv) or its bfloat16-qkv form, which writes q to q_out."""
    checks: tuple[tuple[str, Callable[[Sym], bool]], ...] = (
        _HALF,
        (
            "qkv rows hold num_heads q, then num_kv_heads k and v heads",
            lambda s: s["num_heads"] >= 0 and s["width"] >= (s["num_heads"] + 2 * s["num_kv_heads"]) * s["head_dim"],
        ),
    )
    if q_out is not None:
        checks += (
            (
                "q_out holds the num_heads q heads of each token",
                lambda s: s["q_size"] == s["num_heads"] * s["head_dim"],
            ),
        )
    return KernelSpec(
        name,
        (
            ("qkv", qkv),
            ("row_stride", Int("row_stride")),
            ("num_tokens", Int("num_tokens")),
            ("num_heads", Int()),
            ("num_kv_heads", Int("num_kv_heads")),
            ("head_dim", Int("head_dim")),
            ("cos", Tensor(F32, ("num_tokens", "half"))),
            ("sin", Tensor(F32, ("num_tokens", "half"))),
            ("q_norm", Tensor(F32, ("head_dim",), optional=True)),
            ("k_norm", Tensor(F32, ("head_dim",), optional=True)),
            ("eps", Float()),
            ("k_cache", _cache(writes=True)),
            ("v_cache", _cache(writes=True)),
            ("slots", Tensor(I64, ("num_tokens",), values=(_zero, _slots))),
            ("kv_format", Int()),
        )
        + ((("q_out", q_out),) if q_out is not None else ()),
        checks=checks,
        dtype_checks=(_kv_format_check("k_cache"),),
    )


# the attention kernels' heads and paged cache, in their order in each signature
_HEADS_AND_CACHE = (
    ("num_heads", Int("num_heads")),
    ("num_kv_heads", Int("num_kv_heads")),
    ("head_dim", Int("head_dim")),
    ("k_cache", _cache()),
    ("v_cache", _cache()),
    ("block_size", Int("block_size")),
)
# kvp_prefill_attention and its AMX twin (prefill_amx.cpp) take the same arguments
_PREFILL_ARGS = (
    *_ATTENTION_Q,
    ("num_chunks", Int("num_chunks")),
    ("token_start", Tensor(I64, ("num_chunks",), values=(_zero, lambda s: s["q_rows"]))),
    ("query_len", Tensor(I64, ("num_chunks",), values=(_one, lambda s: s["q_rows"] + 1))),
    ("seq_len", Tensor(I64, ("num_chunks",), values=(_one, _context))),
    *_HEADS_AND_CACHE,
    ("block_tables", Tensor(I64, ("num_chunks", "max_blocks"), values=(_zero, lambda s: s["num_blocks"]))),
    ("max_blocks", Int("max_blocks")),
    ("window", Int()),
    ("scale", Float()),
    ("kv_format", Int()),
)
_PREFILL_RULES: dict[str, Any] = dict(
    returns="int64_t",
    checks=(_GQA, ("window >= 0", lambda s: s["window"] >= 0)),
    dtype_checks=(_kv_format_check("k_cache"),),
    tensor_checks=(
        (
            "each chunk's tokens lie in q and its queries in its context",
            lambda t, s: bool(
                ((t["token_start"] + t["query_len"] <= s["q_rows"]) & (t["query_len"] <= t["seq_len"])).all()
            ),
        ),
    ),
)

SPECS: tuple[KernelSpec, ...] = (
    KernelSpec("kvp_set_num_threads", (("n", Int()),)),
    KernelSpec("kvp_max_threads", (), returns="int64_t"),
    KernelSpec("kvp_isa", (), returns="int64_t"),
    KernelSpec("kvp_linear_b_fast", (), returns="int64_t"),
    KernelSpec(
        "kvp_check_range",
        (("values", Tensor(I64, ("n",))), ("n", Int("n")), ("lo", Int()), ("hi", Int())),
        returns="int64_t",
    ),
    KernelSpec(  # the binding's own call (fastcall.py); the lengths inside `limits` are not checked
        "kvp_check_ranges",
        (
            ("limits", Tensor(I64, ("num_limits",))),
            *((f"v{i}", Tensor(I64, (f"n{i}",), optional=True)) for i in range(4)),
        ),
        returns="int64_t",
        checks=(
            (
                "limits holds a count, then (n, lo, hi) per array",
                lambda s: s["num_limits"] >= 1 and (s["num_limits"] - 1) % 3 == 0,
            ),
        ),
    ),
    KernelSpec(
        "kvp_linear_small",
        (
            ("x", Tensor(F32, ("M", "K"))),
            ("M", Int("M")),
            ("K", Int("K")),
            ("w", Tensor(F32, ("N", "K"))),
            ("N", Int("N")),
            ("bias", Tensor(F32, ("N",), optional=True)),
            ("out", Tensor(F32, ("M", "N"), writes=True)),
        ),
    ),
    KernelSpec(
        "kvp_linear_b",
        (
            ("x", Tensor(F32, ("M", "K"))),
            ("M", Int("M")),
            ("K", Int("K")),
            ("wb", Tensor(F32, ("blocks", "K", 16), row_stride="bs")),
            ("bs", Int("bs")),
            ("N", Int("N")),
            ("bias", Tensor(F32, ("N",), optional=True)),
            ("out", Tensor(F32, ("M", "N"), writes=True)),
        ),
        checks=(("out has 16 columns per weight block", lambda s: s["N"] == 16 * s["blocks"]),),
    ),
    KernelSpec(
        "kvp_unblock",
        (
            ("wb", Tensor(F32, ("blocks", "K", 16), row_stride="bs")),
            ("bs", Int("bs")),
            ("N", Int(lambda s: 16 * s["blocks"])),
            ("K", Int("K")),
            ("out", Tensor(F32, ("KN",), writes=True)),
        ),
        checks=(("out holds the K x N weight", lambda s: s["KN"] == 16 * s["blocks"] * s["K"]),),
    ),
    KernelSpec(
        "kvp_rms_norm",
        (
            ("x", Tensor(F32, ("rows", "dim"), row_stride="x_stride")),
            ("x_stride", Int("x_stride")),
            ("w", Tensor(F32, ("dim",))),
            ("out", Tensor(F32, ("rows", "dim"), writes=True, row_stride="out_stride")),
            ("out_stride", Int("out_stride")),
            ("rows", Int("rows")),
            ("dim", Int("dim")),
            ("eps", Float()),
        ),
    ),
    KernelSpec(
        "kvp_add_rms_norm",
        (
            ("residual", Tensor(F32, ("rows", "dim"), writes=True)),
            ("x", Tensor(F32, ("rows", "dim"))),
            ("w", Tensor(F32, ("dim",))),
            ("out", Tensor(F32, ("rows", "dim"), writes=True)),
            ("rows", Int("rows")),
            ("dim", Int("dim")),
            ("eps", Float()),
        ),
    ),
    KernelSpec(
        "kvp_add_rms_norm_bf16",
        (
            ("residual", Tensor(F32, ("rows", "dim"), writes=True)),
            ("x", Tensor(BF16, ("rows", "dim"))),
            ("w", Tensor(F32, ("dim",))),
            ("out", Tensor(BF16, ("rows", "dim"), writes=True)),
            ("rows", Int("rows")),
            ("dim", Int("dim")),
            ("eps", Float()),
        ),
    ),
    _silu_mul_spec("kvp_silu_mul", F32),
    _silu_mul_spec("kvp_silu_mul_bf16", BF16),
    _rope_spec("kvp_rope_and_cache", Tensor(F32, ("num_tokens", "width"), writes=True, row_stride="row_stride")),
    _rope_spec(
        "kvp_rope_and_cache_bf16",
        Tensor(BF16, ("num_tokens", "width"), row_stride="row_stride"),
        q_out=Tensor(F32, ("num_tokens", "q_size"), writes=True),
    ),
    KernelSpec(
        "kvp_paged_decode",
        (
            *_ATTENTION_Q,
            ("rows", Tensor(I64, ("num_seqs",), optional=True, values=(_zero, lambda s: s["q_rows"]))),
            ("num_seqs", Int("num_seqs")),
            *_HEADS_AND_CACHE,
            ("block_tables", Tensor(I64, ("num_seqs", "max_blocks"), values=(_zero, lambda s: s["num_blocks"]))),
            ("max_blocks", Int("max_blocks")),
            ("seq_lens", Tensor(I64, ("num_seqs",), values=(_one, _context))),
            ("window", Int()),
            ("scale", Float()),
            ("partition", Int()),
            ("kv_format", Int()),
        ),
        checks=(_GQA, _PARTITION),
        dtype_checks=(_kv_format_check("k_cache"),),
    ),
    KernelSpec("kvp_prefill_attention", _PREFILL_ARGS, **_PREFILL_RULES),
    KernelSpec("kvp_prefill_attention_amx", _PREFILL_ARGS, **_PREFILL_RULES),
    KernelSpec("kvp_amx_attention_ready", (), returns="int64_t"),
    KernelSpec(
        "kvp_decode_layers",
        (
            ("x", Tensor(F32, ("M", "H"), writes=True)),
            ("residual", Tensor(F32, ("M", "H"), writes=True)),
            ("M", Int("M")),
            ("H", Int("H")),
            ("num_layers", Int("num_layers")),
            ("layers", Tensor(I64, ("num_layers", LAYER_TABLE_WIDTH))),
            ("num_heads", Int()),
            ("num_kv_heads", Int("num_kv_heads")),
            ("head_dim", Int("head_dim")),
            ("inter", Int()),
            ("eps", Float()),
            (
                "kv_cache",
                Tensor(
                    KV,
                    ("num_layers", 2, "num_blocks", "block_size", "num_kv_heads", "head_dim"),
                    writes=True,
                    dtype_as="kv",
                ),
            ),
            ("num_blocks", Int("num_blocks")),
            ("block_size", Int("block_size")),
            ("cos", Tensor(F32, ("M", "half"))),
            ("sin", Tensor(F32, ("M", "half"))),
            ("slots", Tensor(I64, ("M",), values=(_zero, _slots))),
            ("block_tables", Tensor(I64, ("M", "max_blocks"), values=(_zero, lambda s: s["num_blocks"]))),
            ("max_blocks", Int("max_blocks")),
            ("seq_lens", Tensor(I64, ("M",), values=(_one, _context))),
            ("window", Int()),
            ("scale", Float()),
            ("partition", Int()),
            ("scratch", Tensor(F32, ("scratch_size",), writes=True)),
            ("kv_format", Int()),
            ("packed_linear", Int()),  # kvq_linear's address (a 16-bit weight in the table), else 0
            ("packed_level", Int()),
            ("dot_linear", Int()),  # kvq_dot_linear's address (an int8-activation weight in the table), else 0
            ("dot_level", Int()),
            ("weight_parts", Tensor(I64, ("num_layers", 4, MAX_PARTS, PART_WIDTH))),  # per weight: see above
        ),
        checks=(
            _GQA,
            _HALF,
            _PARTITION,
            (
                "scratch holds M * (2 q + 2 kv + 3 inter + H + max(q + 2 kv, 2 inter, H)) floats",
                lambda s: s["inter"] > 0 and s["scratch_size"] >= decode_layers_scratch(s),
            ),
        ),
        dtype_checks=(_kv_format_check("kv_cache"),),
        tensor_checks=(
            (
                "a packed 16-bit weight or exact quantized part in the layer table needs packed_linear (kvq_linear)",
                lambda t, s: (
                    s["packed_linear"] != 0
                    or (
                        all(c >= 0 or c == PARTS_LAYOUT for c in _layout_codes(t)) and PART_PACKED not in _part_kinds(t)
                    )
                ),
            ),
            (
                "an int8-activation part in the layer table needs dot_linear (kvq_dot_linear's address)",
                lambda t, s: s["dot_linear"] != 0 or PART_DOT not in _part_kinds(t),
            ),
            (
                "weight_parts gives each quantized weight row parts of known kinds adding up to its width",
                _parts_fit,
            ),
        ),
    ),
)
