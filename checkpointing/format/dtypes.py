"""The dtypes a manifest may name (an allowlist: names from disk never reach getattr(torch, ...))."""

from __future__ import annotations

import torch

from checkpointing.errors import ManifestError

_NAMES = (
    "float64", "float32", "float16", "bfloat16", "complex128", "complex64", "complex32",
    "int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64", "bool",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
)

BY_NAME: dict[str, torch.dtype] = {n: getattr(torch, n) for n in _NAMES if isinstance(getattr(torch, n, None), torch.dtype)}
NAME_OF: dict[torch.dtype, str] = {d: n for n, d in BY_NAME.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return NAME_OF[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} cannot be checkpointed (supported: {', '.join(BY_NAME)})") from None


def dtype_from_name(name: object) -> torch.dtype:
    if not isinstance(name, str) or name not in BY_NAME:
        raise ManifestError(f"unknown dtype {name!r} in manifest (known: {', '.join(BY_NAME)})")
    return BY_NAME[name]


def itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize
