"""The values that cross interop's modules: what a conversion takes, what an export or import did (layer: interop, pure).

`Conversion` is the selection and renaming every converter shares (export to safetensors or to a
torch.save file, import): `only`/`exclude` glob patterns over "/"-joined keys, `strip_prefix` of a
written name, and `dtype`, the floating-point dtype floating tensors are cast to (integer and bool
tensors keep theirs). It is checked when made: a wrong value raises CheckpointConfigError saying
how to fix it.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterable

import torch

from checkpointing.errors import CheckpointConfigError

DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*")


def parse_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    """"bf16"/"fp16"/"fp32" (or a floating torch.dtype) -> the torch dtype; None stays None."""
    if value is None or (isinstance(value, torch.dtype) and value.is_floating_point):
        return value
    found = DTYPES.get(value.lower()) if isinstance(value, str) else None
    if found is None:
        raise CheckpointConfigError(f"dtype={value!r} is not one of bf16, fp16, fp32 (it casts the floating-point tensors only)")
    return found


def parse_size(value: int | str) -> int:
    """A byte count: an int, or "5GB" (decimal units, as Hugging Face's max_shard_size) / "512MiB" (binary)."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        m = _SIZE.fullmatch(value) if isinstance(value, str) else None
        unit = _UNITS.get(m.group(2).upper()) if m else None
        if m is None or unit is None:
            raise CheckpointConfigError(f"size {value!r} is not a size: write e.g. 5GB, 500MB, 2GiB or a number of bytes")
        n = int(float(m.group(1)) * unit)
    if n < 1:
        raise CheckpointConfigError(f"size {value!r} must be at least 1 byte")
    return n


def _patterns(value: str | Iterable[str] | None, name: str) -> tuple[str, ...]:
    patterns = () if value is None else (value,) if isinstance(value, str) else tuple(value)
    for p in patterns:
        if not isinstance(p, str) or not p:
            raise CheckpointConfigError(f"{name}= takes glob patterns over keys such as 'model' or 'model/*', got {p!r}")
    return patterns


@dataclasses.dataclass(frozen=True)
class Conversion:
    """Which tensors a conversion takes and how it writes them (see the module docstring)."""

    only: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    strip_prefix: str | None = None
    dtype: torch.dtype | None = None

    @classmethod
    def of(cls, only: str | Iterable[str] | None = None, exclude: str | Iterable[str] | None = None,
           strip_prefix: str | None = None, dtype: str | torch.dtype | None = None) -> "Conversion":
        if strip_prefix is not None and (not isinstance(strip_prefix, str) or not strip_prefix):
            raise CheckpointConfigError(f"strip_prefix={strip_prefix!r}: pass the leading text to remove from each name, e.g. 'model.'")
        return cls(_patterns(only, "only"), _patterns(exclude, "exclude"), strip_prefix, parse_dtype(dtype))

    def cast(self, t: torch.Tensor) -> torch.Tensor:
        """`t` in the conversion's dtype when it is a floating-point tensor; anything else as it is."""
        if self.dtype is None or not t.is_floating_point() or t.dtype == self.dtype:
            return t
        return t.to(self.dtype)

    def out_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return self.dtype if self.dtype is not None and dtype.is_floating_point else dtype


@dataclasses.dataclass(frozen=True)
class ExportResult:
    """What an export wrote."""

    step: int
    files: tuple[str, ...]  # the paths written (safetensors: the shard files, then the index)
    tensors: int  # tensors written
    nbytes: int  # bytes of tensor data written (after any dtype cast)
    tied: dict[str, str] = dataclasses.field(default_factory=dict)  # a name not written -> the name it shares memory with


@dataclasses.dataclass(frozen=True)
class ImportResult:
    """What an import committed."""

    step: int
    dest: str  # the directory or URL the step was committed to
    source_kind: str  # "dcp", "torch", "safetensors" or "hf"
    tensors: int
    nbytes: int
