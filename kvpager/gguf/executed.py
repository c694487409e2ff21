"""How kvpager executes each tensor of a GGUF file, and the bytes it then holds. Torch-free.

One definition for both sides: the loader (kvpager/model/gguf_weights.py) packs exactly the tensors
`packed_form` names, in that form, and checks each packed weight's bytes against
`PackedForm.num_bytes`; the planner (`kvpager plan FILE.gguf`) sums the same numbers.

llama.cpp's tensor names map to transformers' (`checkpoint_name`, without "model."). A linear weight
(a projection or an untied lm_head) of a type in PACKED_FORMS runs from its blocks' own codes and
scales (and offsets), on a CPU with the packed-weight kernels and without --quantization. Q8_0 and
Q4_0 keep the file's float16 scales (exact, and fewer bytes to read per token); the other types' scales
are products (d * sub-block scale), held as float32, as are all offsets:

| ggml type | executed as                    | resident bytes/weight | file bytes/weight |
|-----------|--------------------------------|-----------------------|-------------------|
| Q8_0      | int8 g32, float16 scales       | 1 + 2/32 = 1.0625     | 34/32 = 1.0625    |
| Q4_0      | int4 g32 symmetric, f16 scales | 0.5 + 2/32 = 0.5625   | 18/32 = 0.5625    |
| Q4_K      | int4 g32 (scale + offset)      | 0.75                  | 144/256 = 0.5625  |
| Q5_K      | int8 g32 + per-group offset    | 1 + 8/32 = 1.25       | 176/256 = 0.6875  |
| Q6_K      | int8 g16                       | 1 + 4/16 = 1.25       | 210/256 = 0.8203  |

With --gguf-int8-activations (the integer-dot kernels) Q4_K, Q5_K and Q6_K instead keep the file's
factors (`DOT_FORMS`), per super-block of 256: Q4_K float16 d and dmin and the 8 six-bit scales and
mins a byte each, 0.5 + 20/256 = 0.578 bytes a weight (the file's 0.5625 but for the 6-bit fields'
padding); Q5_K the same record beside int4 codes (the low 4 bits) and a plane of the fifth bits,
0.5 + 0.125 + 20/256 = 0.703 (the file's 0.6875); Q6_K float16 d and the 16 int8 scales beside int4
codes (the low 4 bits) and a plane of the high two, 0.5 + 0.25 + 18/256 = 0.820 (the file's). The
kernel expands d * sc (and -dmin * m) of the rows it multiplies, the same float32 values.

Q5_K's codes sit in int8 in the exact path's form because the exact kernels read 8- and 4-bit codes only.
Every other tensor (the embedding, norms, biases; every tensor when not packed) is held as floats.
With --gguf-int8-activations a model whose lm_head is tied to the embedding also holds a packed copy
of the embedding's blocks for the lm_head (`tied_lm_head_form`): the lookup keeps its float table, and
each decode step reads the file's form (Q6_K: 0.82 bytes a weight) instead of the float table (2).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvpager.gguf.blocks import K_RECORD_BYTES, Q6_RECORD_BYTES, QK_K
from kvpager.gguf.reader import GGUFError, GGUFModel

FLOAT_TYPES = ("F32", "F16", "BF16")
QUANTIZED_TYPES = ("Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K")
SUPPORTED_TENSOR_TYPES = FLOAT_TYPES + QUANTIZED_TYPES
INT4_SPAN = 16  # int4 codes per 8-byte span (kvpager.model.backends.quant_weights.INT4_SPAN)
SCALE_BYTES = 4  # float32 scales and offsets
HALF_SCALE_BYTES = 2  # float16 scales (Q8_0, Q4_0: the file's own)

_GLOBAL_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_PATTERN = re.compile(r"^blk\.(\d+)\.(.+)$")
# Linear weights under their checkpoint names (before q/k/v and gate/up are fused).
LINEAR_SUFFIXES = tuple(f"{p}_proj.weight" for p in ("q", "k", "v", "o", "gate", "up", "down"))


@dataclass(frozen=True)
class PackedForm:
    """A packed weight format built from a ggml type's blocks, without requantization."""

    name: str  # as the start-up log and the planner say it
    group: int  # weights per scale (and offset), along a row
    # 8: one int8 per weight; 4: two codes per byte, in spans of INT4_SPAN; 5 and 6: 4 and a plane of the rest
    code_bits: int
    offsets: bool  # a float32 offset per group beside the scale
    half_scales: bool = False  # float16 scales (the file's); otherwise float32
    # bytes of a super-block record (256 weights) held instead of scales and offsets: K_RECORD_BYTES (Q4_K),
    # Q6_RECORD_BYTES (Q6_K), 0: none
    record_bytes: int = 0

    def num_bytes(self, rows: int, cols: int) -> int:
        """Bytes the packed weight of a [rows, cols] tensor holds (codes, scales, offsets)."""
        groups = -(-cols // self.group)
        codes = cols if self.code_bits == 8 else -(-cols // INT4_SPAN) * (INT4_SPAN // 2)
        if self.code_bits in (5, 6):
            codes += -(-cols * (self.code_bits - 4) // 8)  # the bits above the int4 codes
        if self.record_bytes:
            return rows * (codes + -(-cols // QK_K) * self.record_bytes)
        scale = HALF_SCALE_BYTES if self.half_scales else SCALE_BYTES
        return rows * (codes + groups * (scale + (SCALE_BYTES if self.offsets else 0)))


PACKED_FORMS = {
    "Q8_0": PackedForm("int8 g32, float16 scales", 32, 8, False, half_scales=True),
    "Q4_0": PackedForm("int4 g32 symmetric, float16 scales", 32, 4, False, half_scales=True),
    "Q4_K": PackedForm("int4 g32", 32, 4, True),
    "Q5_K": PackedForm("int8 g32 + per-group offset", 32, 8, True),
    "Q6_K": PackedForm("int8 g16", 16, 8, False),
}


# the integer-dot kernels' forms where they differ from PACKED_FORMS (--gguf-int8-activations)
DOT_FORMS = {
    "Q4_K": PackedForm("int4 g32, the file's super-block scales", 32, 4, True, record_bytes=K_RECORD_BYTES),
    "Q5_K": PackedForm(
        "int4 g32 + a fifth-bit plane, the file's super-block scales", 32, 5, True, record_bytes=K_RECORD_BYTES
    ),
    "Q6_K": PackedForm(
        "int4 g16 + a plane of the high two bits, the file's super-block scales",
        16,
        6,
        False,
        record_bytes=Q6_RECORD_BYTES,
    ),
}


def checkpoint_name(gguf_name: str, model: GGUFModel) -> str:
    """llama.cpp's tensor name -> transformers' (without "model."); GGUFError for a name kvpager does not use."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_PATTERN.match(gguf_name)
    if match is not None and match[2] in _LAYER_NAMES:
        return f"layers.{match[1]}.{_LAYER_NAMES[match[2]]}"
    raise GGUFError(
        f"GGUF file {str(model.path)!r} holds tensor {gguf_name!r}, which a {model.architecture} model does not use"
    )


def is_linear_weight(name: str) -> bool:
    """A projection or the lm_head (checkpoint names): the weights that may run packed."""
    return name.endswith(LINEAR_SUFFIXES) or name == "lm_head.weight"


# ggml types whose blocks the integer-dot kernels read (groups of 32; Q6_K's of 16, two per activation
# block; Q5_K's and Q6_K's codes as int4 codes and a plane of their higher bits): --gguf-int8-activations
INT8_DOT_TYPES = ("Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K")


def tied_lm_head_form(embedding_type: str, *, packed_kernels: bool, int8_activations: bool) -> PackedForm | None:
    """The form of the packed lm_head copy a tied model holds beside its embedding table, or None (the
    lm_head multiplies the float table): with --gguf-int8-activations, for an embedding of a type the
    integer-dot kernels read. Without it the table stays the lm_head: the exact kernels read Q6_K's int8
    group-16 form no faster than bf16."""
    if not (packed_kernels and int8_activations) or embedding_type not in INT8_DOT_TYPES:
        return None
    return DOT_FORMS.get(embedding_type, PACKED_FORMS[embedding_type])


def packed_form(
    name: str, type_name: str, *, packed_kernels: bool, int8_activations: bool = False
) -> PackedForm | None:
    """The form tensor `name` (checkpoint name) of ggml type `type_name` executes in, or None (floats).

    `packed_kernels`: a CPU with kvpager's packed-weight kernels and no --quantization (which
    requantizes from floats) or tensor parallelism (which slices floats). `int8_activations`: with
    --gguf-int8-activations (types in INT8_DOT_TYPES run on the integer-dot kernels: DOT_FORMS)."""
    if not packed_kernels or not is_linear_weight(name):
        return None
    if int8_activations and type_name in DOT_FORMS:  # (DOT_FORMS' types are INT8_DOT_TYPES)
        return DOT_FORMS[type_name]
    return PACKED_FORMS.get(type_name)
