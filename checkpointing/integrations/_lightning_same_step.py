"""A second save at a global step LightningCheckpointIO saved already (layer: integrations; no Lightning import here).

The rules are in docs/design.md, "The Lightning plugin" (two saves at one global step): the marks that
tell, without reading a byte, that a save's entries are those of the step (`marks`, `differing`), the
byte comparison where a mark differs (`equal`), what a pointer reads of its step (`view_of`), and
load()'s patterns for top-level keys (`literal`).
"""

from __future__ import annotations

import math
import re
from typing import Any, Iterable, Mapping, Sequence

import torch

_PLAIN = re.compile(r"[^*?\[\]/]+")  # a top-level key a load's keys=/exclude= pattern names literally


def marks(checkpoint: Mapping[str, Any]) -> dict[str, list]:
    """Per entry of `checkpoint`: what changes when its content may have (compared with ==)."""
    return {k: _marks(v, []) for k, v in checkpoint.items()}


def differing(known: Mapping[str, list], checkpoint: Mapping[str, Any], keys: Iterable[str]) -> set[str]:
    """The entries among `keys` whose marks differ from `known` (the marks of the step's own save)."""
    return {k for k in keys if known.get(k) != _marks(checkpoint[k], [])}


def equal(a: Any, b: Any) -> bool:
    """Same structure, same types, bitwise-equal tensors (NaNs included) on any device."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dtype != b.dtype or a.shape != b.shape:
            return False
        try:
            return torch.equal(_bits(a), _bits(b))
        except (RuntimeError, TypeError):
            return False
    if isinstance(a, Mapping):
        return isinstance(b, Mapping) and list(a) == list(b) and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - a type whose == does not answer a bool: not known equal
        return False


def view_of(pointer: Any, step_keys: Sequence[str], own: Mapping[str, Any]) -> tuple[Mapping[str, Any], dict[str, str], tuple[str, ...]]:
    """A pointer's own entries `own`, for each other key it loads the step's entry it reads, and its keys in order
    (its own, else the step's)."""
    keys = tuple(pointer.keys if pointer.keys is not None else step_keys)
    return own, {k: pointer.stored(k) for k in keys if k not in own}, keys


def literal(keys: Iterable[Any]) -> list[str] | None:
    """`keys` as load()'s patterns naming exactly them; None when one cannot be (glob characters, '/', not a str)."""
    names = list(keys)
    return names if all(isinstance(k, str) and _PLAIN.fullmatch(k) for k in names) else None


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _marks(value: Any, out: list) -> list:
    if isinstance(value, torch.Tensor):
        out.append(_tensor_mark(value))
    elif isinstance(value, Mapping):
        out.append(("{}", len(value)))
        for k, v in value.items():
            out.append(_scalar(k))
            _marks(v, out)
    elif isinstance(value, (list, tuple)):
        out.append((type(value).__name__, len(value)))
        for v in value:
            _marks(v, out)
    else:
        out.append(_scalar(value))
    return out


def _tensor_mark(t: torch.Tensor) -> tuple:
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
        return ("T", object())  # a subclass (DTensor, ...): never equal here, the bytes are compared
    try:
        return (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device, t._version)
    except (RuntimeError, NotImplementedError):  # no memory of its own (meta, ...)
        return ("T", object())


def _scalar(v: Any) -> tuple:
    if isinstance(v, float):
        return ("float", repr(v))  # nan equals nan here
    if v is None or isinstance(v, (bool, int, str, bytes)):
        return (type(v).__name__, v)
    return ("?", object())  # another type: never equal here, compared by value with the step's bytes
