"""Formats in and out: Hugging Face safetensors export, import from DCP / torch.save / safetensors,
and a DCP StorageReader over our checkpoints (layer: interop, above restore and the manager).

    from checkpointing.interop import export_safetensors, import_checkpoint
    export_safetensors("ckpt/", "hf_out/", only="model")             # model.safetensors (+ index when sharded)
    import_checkpoint("dcp_dir/", "ckpt/", step=0, under=None)        # a DCP checkpoint as step 0

Names are loaded on first use (PEP 562), so `import checkpointing.interop` imports neither the
safetensors library nor torch.distributed.checkpoint: each comes with the function that needs it.
Modules: types.py (options and results), source.py (a step opened for reading), naming.py (which
tensors, which names), safetensors_export.py, torch_export.py, readers.py (other formats read),
importer.py (committing an import), dcp.py (the DCP StorageReader).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from checkpointing.interop.dcp import CheckpointReader
    from checkpointing.interop.importer import import_checkpoint
    from checkpointing.interop.safetensors_export import export_safetensors
    from checkpointing.interop.torch_export import export_torch
    from checkpointing.interop.types import ExportResult, ImportResult

_WHERE = {
    "export_safetensors": "checkpointing.interop.safetensors_export",
    "export_torch": "checkpointing.interop.torch_export",
    "import_checkpoint": "checkpointing.interop.importer",
    "ExportResult": "checkpointing.interop.types",
    "ImportResult": "checkpointing.interop.types",
    "CheckpointReader": "checkpointing.interop.dcp",
}

__all__ = ["export_safetensors", "export_torch", "import_checkpoint", "ExportResult", "ImportResult", "CheckpointReader"]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'checkpointing.interop' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
