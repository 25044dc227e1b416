"""torch dtypes by name, for manifests: every dtype a checkpoint can hold, none pickled."""

from __future__ import annotations

import torch

from rlsync.errors import InvalidArgument

_NAMES = ["float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
          "float8_e5m2fnuz", "float8_e8m0fnu", "complex64", "complex128", "int64", "int32", "int16", "int8",
          "uint8", "uint16", "uint32", "uint64", "bool"]
DTYPES: dict[str, torch.dtype] = {n: getattr(torch, n) for n in _NAMES if hasattr(torch, n)}
NAMES: dict[torch.dtype, str] = {d: n for n, d in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return NAMES[dtype]
    except KeyError:
        raise InvalidArgument(f"dtype {dtype} cannot be transferred (supported: {', '.join(DTYPES)})") from None


def dtype_of(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise InvalidArgument(f"unknown dtype {name!r} in manifest (supported: {', '.join(DTYPES)})") from None


ITEMSIZE: dict[torch.dtype, int] = {d: torch.empty(0, dtype=d).element_size() for d in DTYPES.values()}


def itemsize(dtype: torch.dtype) -> int:
    return ITEMSIZE[dtype] if dtype in ITEMSIZE else torch.empty(0, dtype=dtype).element_size()
