"""Apply a planned restore's values to the user's objects (layer: restore): load_state_dict() on stateful
objects, what it raises named by key (`load_into`), and values assigned into the user's containers in place
(`assign`: nested dicts and same-length lists updated, anything else replaced).
"""

from __future__ import annotations

import collections
from typing import Any, MutableMapping

import torch

from checkpointing.errors import CheckpointError


def load_into(target: Any, sd: dict, key: str, strict: bool, metadata: Any = None) -> None:
    """target.load_state_dict(sd): what it raises, as a CheckpointError naming the key. A module's gets `metadata`, the
    version of each submodule as its own state_dict() gives them (the step matched its keys): a module converting an
    older version's state in its _load_from_state_dict() must not take a step of its current version for an older one."""
    if metadata is not None and isinstance(target, torch.nn.Module):
        sd = collections.OrderedDict(sd)
        sd._metadata = metadata  # type: ignore[attr-defined]
    try:
        target.load_state_dict(sd, strict=strict) if isinstance(target, torch.nn.Module) else target.load_state_dict(sd)
    except Exception as exc:  # noqa: BLE001 - the user's object: say which, and what is applied
        raise CheckpointError(f"{key}: {type(target).__name__}.load_state_dict() raised {type(exc).__name__}: {exc}. The tensors "
                              "and the objects before it hold the step's values, the rest not: fix it, or leave it out with "
                              f"exclude=[{key!r}], then restore again") from exc


def assign(container: Any, key: Any, value: Any) -> None:
    """Put `value` into container[key], updating nested dicts and lists in place."""
    current = container[key]
    if current is value:
        return
    if isinstance(current, MutableMapping) and isinstance(value, dict):
        for k, v in value.items():
            if k in current:
                assign(current, k, v)
            else:
                current[k] = v
        return
    if isinstance(current, list) and isinstance(value, list) and len(current) == len(value):
        for i, v in enumerate(value):
            assign(current, i, v)
        return
    container[key] = value
