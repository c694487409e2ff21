"""The torch side of the dtype names in `kvpager.core.config.DTYPES`: one map for loader, codecs and packs."""

from __future__ import annotations

import torch

from kvpager.core.config import DTYPES

TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPES}


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' / 'float16' / 'bfloat16': the dtype spelling stored in configs, records and packs."""
    for name, value in TORCH_DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"dtype {dtype} is not supported; use one of {sorted(TORCH_DTYPES)}")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of `dtype_name`; also accepts the 'torch.' prefix."""
    dtype = TORCH_DTYPES.get(name.removeprefix("torch."))
    if dtype is None:
        raise ValueError(f"dtype {name!r} is not supported; use one of {sorted(TORCH_DTYPES)}")
    return dtype
