"""The fast path of a checked kernel call (binding.py): a kernel's `__call__` and `_signature`
methods, generated once from its declaration.

A call's signature is everything the structural checks read: for each tensor its type, dtype,
whether it is on the CPU, its shape and `is_contiguous() or stride()` (True for a contiguous tensor,
its strides otherwise), `None` for an absent optional tensor; each int's type and value; each
float's type. Two calls with equal signatures pass or fail the structural checks alike and derive
the same sizes and strides, so after one full check (`_checked`) the binding caches what it derived
(an `Entry`) under the signature.

The generated `__call__` takes the kernel's parameters as keyword-only arguments, looks their
signature up (first in `_last`, the last signature found and its entry, one tuple replaced whole so
threads never see a signature with another's entry; comparing is cheaper than hashing) and, on a
hit, checks the bounded index tensors' values over the data passed this time (one
`kvp_check_ranges` call for each group of up to four, with the entry's (n, lo, hi) of each: one C
call, not one per tensor; the lowest bit set in its result names the first tensor out of range,
the one the full checks name) and the spec's tensor checks, then calls the C function with the
data pointers, the cached ints and the caller's floats in C order. Anything else (a miss, a
missing or unknown argument, a value that is not a tensor) goes to the full check. For
kvp_rms_norm (x, x_stride, w, out, out_stride, rows, dim, eps; no index tensors):

    def __call__(_self, *, x=_MISSING, w=_MISSING, out=_MISSING, eps=_MISSING, **_extra):
        try:
            if _extra:
                raise KeyError
            _k = (type(x), x.dtype, x.is_cpu, x.shape, x.is_contiguous() or x.stride(), ..., type(eps),)
            _last = _self._last
            if _k == _last[0]:
                _e = _last[1]
            else:
                _e = _self._cache[_k]
                _self._last = (_k, _e)
            _p_x = x.data_ptr(); _p_w = w.data_ptr(); _p_out = out.data_ptr()
        except (KeyError, AttributeError, TypeError, RuntimeError):
            return _self._checked(_passed({'x': x, 'w': w, 'out': out, 'eps': eps}, _extra))
        _n = _e.ints
        return _self._fn(_p_x, _n[0], _p_w, _p_out, _n[1], _n[2], _n[3], eps)

Generated rather than a loop over the parameters: the signature is one tuple expression and the C
arguments one call expression, about half the time of building them in a loop, and keyword-only
parameters bind without a dict.
"""

from __future__ import annotations

import ctypes
import keyword
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["tensor", "int", "derived", "float"]
Bounds = tuple[int, int, int]  # a bounded tensor's (element count, lo, hi)
RANGES_PER_CALL = 4  # index arrays one kvp_check_ranges call checks
_CAUGHT = (KeyError, AttributeError, TypeError, RuntimeError)


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


_MISSING = _Missing()


@dataclass(frozen=True)
class Entry:
    """What the full checks derived for one signature: the values of the kernel's int parameters in
    C order (the caller's and the derived sizes and strides), each bounded tensor's (element count,
    lo, hi) in declaration order (None where an optional one is absent), the `kvp_check_ranges`
    limits of each group of up to four bounded tensors (the address of {count, (n, lo, hi)...}; an
    absent tensor checks 0 values), and the bound symbols (for the spec's tensor checks). The ints
    and addresses are ctypes objects, made once: ctypes passes them as they are, where it would
    convert a Python int on every call."""

    ints: tuple[ctypes.c_int64, ...]
    bounds: tuple[Bounds | None, ...]
    ranges: tuple[ctypes.c_void_p, ...]
    sym: Mapping[str, int]
    limits: tuple[ctypes.Array[ctypes.c_int64], ...]  # the memory `ranges` points to, kept alive here

    @classmethod
    def of(cls, ints: Iterable[int], bounds: Iterable[Bounds | None], sym: Mapping[str, int]) -> Entry:
        bounds = tuple(bounds)
        limits = []
        for start in range(0, len(bounds), RANGES_PER_CALL):
            group = bounds[start : start + RANGES_PER_CALL]
            flat = [len(group)] + [v for b in group for v in (b if b is not None else (0, 0, 0))]
            limits.append((ctypes.c_int64 * len(flat))(*flat))
        ranges = tuple(ctypes.c_void_p(ctypes.addressof(a)) for a in limits)
        return cls(tuple(ctypes.c_int64(v) for v in ints), bounds, ranges, sym, tuple(limits))


@dataclass(frozen=True)
class CallLayout:
    """A kernel's parameters as the fast path needs them: its name, (name, kind) in C order, the
    optional tensors, the bounded tensors in declaration order, whether the spec has tensor checks."""

    name: str
    params: tuple[tuple[str, Kind], ...]
    optional: frozenset[str]
    bounded: tuple[str, ...]
    tensor_checks: bool


def _passed(named: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments a call was given (the generated methods' defaults taken out)."""
    return {k: v for k, v in named.items() if v is not _MISSING} | extra


def _key(layout: CallLayout) -> str:
    parts = []
    for name, kind in layout.params:
        tensor = f"{name}.dtype, {name}.is_cpu, {name}.shape, {name}.is_contiguous() or {name}.stride()"
        if kind == "tensor" and name in layout.optional:
            parts.append(f"None if {name} is None else (type({name}), {tensor})")
        elif kind == "tensor":
            parts.append(f"type({name}), {tensor}")
        elif kind == "int":
            parts.append(f"type({name}), {name}")
        elif kind == "float":
            parts.append(f"type({name})")
    return f"({', '.join(parts)},)" if parts else "()"


def method_source(layout: CallLayout) -> str:
    """The Python source of `layout`'s `__call__` and `_signature` methods."""
    for name, _ in layout.params:
        if not name.isidentifier() or keyword.iskeyword(name) or name.startswith("_"):
            raise ValueError(f"{layout.name}: parameter name {name!r} must be an identifier without a leading _")
    passed = [name for name, kind in layout.params if kind != "derived"]
    tensors = [name for name, kind in layout.params if kind == "tensor"]
    defaults = "".join(f"{n}={'None' if n in layout.optional else '_MISSING'}, " for n in passed)
    defaults = f"*, {defaults}" if defaults else ""
    named = "{" + ", ".join(f"{n!r}: {n}" for n in passed) + "}"
    key = _key(layout)
    lines = [
        f"def __call__(_self, {defaults}**_extra):",
        "    try:",
        "        if _extra:",
        "            raise KeyError",
        f"        _k = {key}",
        "        _last = _self._last",
        "        if _k == _last[0]:",
        "            _e = _last[1]",
        "        else:",
        "            _e = _self._cache[_k]",
        "            _self._last = (_k, _e)",
        *(
            f"        _p_{n} = None if {n} is None else {n}.data_ptr()"
            if n in layout.optional
            else f"        _p_{n} = {n}.data_ptr()"
            for n in tensors
        ),
        "    except _CAUGHT:",
        f"        return _self._checked(_passed({named}, _extra))",
        "    _n = _e.ints",
    ]
    if layout.bounded:
        lines.append("    _r = _e.ranges")
    for group, start in enumerate(range(0, len(layout.bounded), RANGES_PER_CALL)):
        names = layout.bounded[start : start + RANGES_PER_CALL]
        pointers = [f"_p_{n}" for n in names] + ["None"] * (RANGES_PER_CALL - len(names))
        pairs = "(" + "".join(f"({n!r}, {n}), " for n in names) + ")"
        lines.append(f"    if _bad := _self._ranges(_r[{group}], {', '.join(pointers)}):")
        lines.append(f"        _self._raise_first_out_of_range(_bad, _e.bounds[{start}:], {pairs})")
    if layout.tensor_checks:
        lines.append(f"    _self._check_tensor_values({named}, _e.sym)")
    args, ints = [], 0
    for name, kind in layout.params:
        if kind in ("int", "derived"):
            args.append(f"_n[{ints}]")
            ints += 1
        else:
            args.append(f"_p_{name}" if kind == "tensor" else name)
    lines += [
        f"    return _self._fn({', '.join(args)})",
        "",
        f"def _signature(_self, {defaults}**_extra):",
        f"    return {key}",
    ]
    return "\n".join(lines) + "\n"


def fast_methods(layout: CallLayout) -> dict[str, Callable[..., Any]]:
    """`layout`'s generated `__call__` and `_signature`, for a subclass of KernelFunction (which
    provides `_cache`, `_last`, `_fn`, `_ranges`, `_checked`, `_raise_first_out_of_range`,
    `_check_tensor_values`)."""
    namespace: dict[str, Any] = {"_MISSING": _MISSING, "_CAUGHT": _CAUGHT, "_passed": _passed}
    exec(compile(method_source(layout), f"<checked call of {layout.name}>", "exec"), namespace)  # noqa: S102
    return {"__call__": namespace["__call__"], "_signature": namespace["_signature"]}
