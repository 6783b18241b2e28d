"""The Python value of a tree node, as DCP loads a non-tensor value (layer: interop; reads tensors it holds).

DCP hands a non-tensor value to its planner as `torch.save` bytes. The reader rebuilds the value
the user saved from the manifest's JSON tree (null/bool/int/float/str, non-finite floats, bytes,
lists, tuples, dicts, objects' state dicts), reads any tensor or numpy array inside it whole
(verified, like every read), and decodes codec values with the codecs the reader was given.
"""

from __future__ import annotations

import base64
import math
from typing import Any

import torch

from checkpointing.errors import CheckpointError
from checkpointing.format.dtypes import dtype_from_name
from checkpointing.format.manifest import Manifest
from checkpointing.restore.reading import ReadBox, Sources, read_box
from checkpointing.state.codecs import Codec

_FLOATS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


class ValueBuilder:
    """Rebuild values from nodes of one step's trees."""

    def __init__(self, manifest: Manifest, sources: Sources, codecs: tuple[Codec, ...]) -> None:
        self._manifest = manifest
        self._sources = sources
        self._codecs = {c.name: c for c in codecs}

    def build(self, node: dict[str, Any], key: str) -> Any:
        """The value `node` stands for; `key` (ours, "/"-joined) names it in errors."""
        if "value" in node:
            return node["value"]
        if "float" in node:
            return _FLOATS[node["float"]]
        if "bytes" in node:
            return base64.b64decode(node["bytes"])
        if "list" in node:
            return [self.build(child, f"{key}/{i}") for i, child in enumerate(node["list"])]
        if "tuple" in node:
            return tuple(self.build(child, f"{key}/{i}") for i, child in enumerate(node["tuple"]))
        if "dict" in node:
            return {k: self.build(child, f"{key}/{k}") for k, child in node["dict"]}
        if "stateful" in node:
            return self.build(node["stateful"], key)
        if "tensor" in node:
            return self._tensor(node["tensor"])
        if "ndarray" in node:
            return self._tensor(node["ndarray"]).numpy()
        if "codec" in node:
            codec = self._codecs.get(node["codec"])
            if codec is None:
                raise CheckpointError(
                    f"step {self._manifest.step}, {key}: saved with codec {node['codec']!r}; pass "
                    f"CheckpointReader(..., codecs=[...]) with that codec, or leave the key out of the state dict"
                )
            return codec.decode(node["data"])
        raise CheckpointError(f"step {self._manifest.step}, {key}: a tree node of unknown kind ({sorted(node)})")

    def _tensor(self, index: int) -> torch.Tensor:
        entry = self._manifest.tensors[index]
        out = torch.empty(entry.shape, dtype=dtype_from_name(entry.dtype))
        read_box(self._sources, self._manifest.step, ReadBox(entry, out, (0,) * len(entry.shape), entry.shape))
        return out
