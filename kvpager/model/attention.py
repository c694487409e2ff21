"""Paged attention in pure torch: per-step metadata, the KV cache tensor, write-then-read attention.

This is the reference backend (CPU and CUDA alike) and the oracle for any faster one.

Cache layout (docs/internals.md):
    kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]   (2 = K, V)
Slot of position p of a sequence with block table bt: bt[p // block_size] * block_size + p % block_size.

Each step the runner calls `build_attention_metadata` once; every layer then
1. writes all new tokens' K/V through `slot_mapping`, and only then
2. attends by gathering each sequence's blocks through its block table,
so a sequence may read blocks another sequence of the same batch wrote in this step.
Decode sequences (query_len == 1) are batched into one SDPA call over padded, masked blocks
(query heads folded onto their KV head, so GQA needs no K/V repeat);
prefill chunks (query_len > 1, maybe after cached context) run one SDPA call each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvpager.model.spec import ModelSpec


@dataclass(slots=True)
class DecodeBatch:
    """All query_len == 1 sequences of a step, attended in one SDPA call."""

    token_indices: torch.Tensor  # [D] int64: rows of the flattened batch
    block_tables: torch.Tensor  # [D, max_blocks] int64: blocks covering the longest context
    key_mask: torch.Tensor  # [D, 1, 1, max_blocks * block_size] bool: True = attend
    seq_lens: torch.Tensor  # [D] int64: context length of each decode sequence (this token included)
    is_leading: bool  # the decode tokens are rows 0..D-1 (slice instead of gather)


@dataclass(slots=True)
class PrefillChunk:
    """One sequence with query_len > 1; its queries start after `seq_len - query_len` cached positions."""

    token_start: int
    token_end: int
    block_ids: torch.Tensor  # [num_blocks] int64: blocks covering seq_len
    mask: torch.Tensor  # [1, 1, query_len, num_blocks * block_size] bool: causal, offset by context
    plain_causal: bool = False  # no cached context and no window cut: the mask is SDPA's is_causal


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs for one step, built once per step (not per layer)."""

    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B + 1] int64
    seq_lens: torch.Tensor  # [B] int64: context length after this step
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0
    query_lens: list[int]
    seq_lens_list: list[int]
    num_decodes: int
    decode: DecodeBatch | None
    prefills: list[PrefillChunk]
    block_size: int
    sliding_window: int | None = None

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_list, default=0)


def allocate_kv_cache(
    spec: ModelSpec, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """The paged KV pool: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], zeroed.

    NOTE: zeroed (not empty) on purpose: padded keys are masked, and a masked NaN still poisons softmax.
    """
    if num_blocks < 1 or block_size < 1:
        raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
    shape = (spec.num_layers, 2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)


def build_attention_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str,
    sliding_window: int | None = None,
) -> AttentionMetadata:
    """Build a step's metadata. Sequence i computes positions seq_lens[i]-query_lens[i] .. seq_lens[i]-1.

    `sliding_window`: pass `spec.sliding_window` (None = full attention). ValueError on inconsistent input.
    """
    _validate(query_lens, seq_lens, block_tables, block_size)
    max_blocks = max(len(bt) for bt in block_tables)
    tables = torch.tensor(
        [bt + [0] * (max_blocks - len(bt)) for bt in block_tables], dtype=torch.int64
    )  # [B, max_blocks]
    q_lens = torch.tensor(query_lens, dtype=torch.int64)
    s_lens = torch.tensor(seq_lens, dtype=torch.int64)
    query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int64)
    torch.cumsum(q_lens, 0, out=query_start_loc[1:])
    slot_mapping = _slot_mapping(tables, q_lens, s_lens, query_start_loc, block_size)
    decode_ids = [i for i, q in enumerate(query_lens) if q == 1]
    decode = _decode_batch(decode_ids, tables, s_lens, query_start_loc, block_size, sliding_window, device)
    starts = query_start_loc.tolist()
    prefills = [
        _prefill_chunk(starts[i], query_lens[i], seq_lens[i], tables[i], block_size, sliding_window, device)
        for i, q in enumerate(query_lens)
        if q > 1
    ]
    return AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        query_start_loc=query_start_loc.to(device),
        seq_lens=s_lens.to(device),
        block_tables=tables.to(device),
        query_lens=list(query_lens),
        seq_lens_list=list(seq_lens),
        num_decodes=len(decode_ids),
        decode=decode,
        prefills=prefills,
        block_size=block_size,
        sliding_window=sliding_window,
    )


def _validate(query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], block_size: int) -> None:
    if not query_lens or not (len(query_lens) == len(seq_lens) == len(block_tables)):
        raise ValueError(
            f"query_lens, seq_lens and block_tables must be non-empty and of equal length, got {len(query_lens)}, {len(seq_lens)}, {len(block_tables)}"
        )
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    for i, (q, s, bt) in enumerate(zip(query_lens, seq_lens, block_tables, strict=True)):
        if not 1 <= q <= s:
            raise ValueError(f"sequence {i}: need 1 <= query_len <= seq_len, got query_len={q}, seq_len={s}")
        if len(bt) * block_size < s:
            raise ValueError(f"sequence {i}: block table of {len(bt)} blocks of {block_size} cannot hold {s} positions")


def _slot_mapping(
    tables: torch.Tensor, q_lens: torch.Tensor, s_lens: torch.Tensor, query_start_loc: torch.Tensor, block_size: int
) -> torch.Tensor:
    """[T] int64 cache slot of every new token, in batch order."""
    seq_of_token = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens)  # [T]
    offset_in_query = torch.arange(int(q_lens.sum())) - query_start_loc[seq_of_token]
    positions = (s_lens - q_lens)[seq_of_token] + offset_in_query  # [T]
    block_ids = tables[seq_of_token, positions // block_size]
    return block_ids * block_size + positions % block_size


def _decode_batch(
    decode_ids: list[int],
    tables: torch.Tensor,
    s_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    block_size: int,
    sliding_window: int | None,
    device: torch.device | str,
) -> DecodeBatch | None:
    if not decode_ids:
        return None
    idx = torch.tensor(decode_ids, dtype=torch.int64)
    lens = s_lens[idx]  # [D]
    num_blocks = -(-int(lens.max()) // block_size)
    key_pos = torch.arange(num_blocks * block_size)[None, :]  # [1, S]
    mask = key_pos < lens[:, None]  # [D, S]
    if sliding_window is not None:
        mask &= key_pos >= (lens[:, None] - sliding_window)
    token_indices = query_start_loc[idx]
    return DecodeBatch(
        token_indices=token_indices.to(device),
        block_tables=tables[idx, :num_blocks].contiguous().to(device),
        key_mask=mask[:, None, None, :].to(device),
        seq_lens=lens.contiguous().to(device),
        is_leading=decode_ids == list(range(len(decode_ids))),
    )


def _prefill_chunk(
    start: int,
    query_len: int,
    seq_len: int,
    table: torch.Tensor,
    block_size: int,
    sliding_window: int | None,
    device: torch.device | str,
) -> PrefillChunk:
    num_blocks = -(-seq_len // block_size)
    key_pos = torch.arange(num_blocks * block_size)[None, :]  # [1, S]
    query_pos = torch.arange(seq_len - query_len, seq_len)[:, None]  # [q, 1]
    mask = key_pos <= query_pos  # [q, S]; also excludes keys >= seq_len
    if sliding_window is not None:
        mask &= key_pos > query_pos - sliding_window
    return PrefillChunk(
        token_start=start,
        token_end=start + query_len,
        block_ids=table[:num_blocks].contiguous().to(device),
        mask=mask[None, None].to(device),
        plain_causal=query_len == seq_len and (sliding_window is None or sliding_window >= seq_len),
    )


def write_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store new K/V [T, num_kv_heads, head_dim] at `slot_mapping` [T] in kv_layer [2, NB, bs, kvh, hd]."""
    num_kv_heads, head_dim = kv_layer.shape[-2:]
    kv_layer[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(kv_layer.dtype))
    kv_layer[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(kv_layer.dtype))


def paged_attention(q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Attend q [T, num_heads, head_dim] over the cached context of each sequence -> [T, num_heads, head_dim]."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    attend_decodes(q, kv_layer, meta, scale, out)
    attend_prefills(q, kv_layer, meta, scale, out)
    return out


def attend_decodes(
    q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float, out: torch.Tensor
) -> None:
    """Write the decode rows (query_len == 1) of `out` [T, H, hd]: one SDPA over gathered, padded blocks."""
    dec = meta.decode
    if dec is None:
        return
    num_dec = dec.token_indices.shape[0]
    q_dec = q[:num_dec] if dec.is_leading else q.index_select(0, dec.token_indices)
    k, v = _gather_kv(kv_layer, dec.block_tables, q.dtype)
    o = _attend_decode(q_dec, k, v, dec.key_mask, scale)
    if dec.is_leading:
        out[:num_dec] = o
    else:
        out.index_copy_(0, dec.token_indices, o)


def attend_prefills(
    q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float, out: torch.Tensor
) -> None:
    """Write the prefill rows (query_len > 1) of `out` [T, H, hd]: one causal SDPA per chunk."""
    for chunk in meta.prefills:
        q_p = q[chunk.token_start : chunk.token_end].transpose(0, 1).unsqueeze(0)  # [1, H, q, hd]
        k, v = _gather_kv(kv_layer, chunk.block_ids.unsqueeze(0), q.dtype)
        if chunk.plain_causal:
            # NOTE: a whole prompt from position 0: SDPA's own causal mask (top-left aligned, so the
            # padding keys past seq_len are never reached) skips the masked half; 1.9x at 2,000 tokens.
            n = chunk.token_end - chunk.token_start
            o = F.scaled_dot_product_attention(
                q_p, k[:, :, :n], v[:, :, :n], is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            o = _attend(q_p, k, v, chunk.mask, scale)
        out[chunk.token_start : chunk.token_end] = o[0].transpose(0, 1)


def _gather_kv(kv_layer: torch.Tensor, tables: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V blocks of `tables` [N, nb] from kv_layer [2, NB, bs, kvh, hd] -> each [N, kvh, nb * bs, hd]."""
    return _gather(kv_layer[0], tables, dtype), _gather(kv_layer[1], tables, dtype)


def _gather(cache: torch.Tensor, tables: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Blocks of `tables` [N, nb] from cache [NB, bs, kvh, hd] -> [N, kvh, nb * bs, hd] in `dtype`."""
    n, nb = tables.shape
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    # NOTE: index_select on a 2-D view copies whole blocks as rows (~3x faster than on the 4-D view;
    # one select over a [2, NB, row] view for K and V together measured slower at batch 64).
    blocks = cache.view(num_blocks, -1).index_select(0, tables.reshape(-1))  # [N * nb, bs * kvh * hd]
    return blocks.view(n, nb * block_size, num_kv_heads, head_dim).transpose(1, 2).to(dtype)


def _attend_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per sequence: q [D, H, hd]; k, v [D, kvh, S, hd]; mask [D, 1, 1, S] -> [D, H, hd].

    NOTE: query head h reads KV head h // (H // kvh), so the H query heads fold into [kvh, group]
    and each KV head sees `group` queries: no K/V repeat, and measured faster here than enable_gqa.
    """
    num_dec, num_heads, head_dim = q.shape
    q = q.view(num_dec, k.shape[1], num_heads // k.shape[1], head_dim)  # [D, kvh, group, hd]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.reshape(num_dec, num_heads, head_dim)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    # q: [N, H, q, hd]; k, v: [N, kvh, S, hd]; mask: [N, 1, q, S] bool
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
