"""Export a committed step as one torch.save file of full (unsharded) tensors (layer: interop).

The file holds only tensors, strings and ints:
    {"step": N, "world_size": W, "tensors": {name: full tensor, ...}, "layout": {name prefix: kind, ...}}
(`layout`: where the saved state had a list, a tuple or a dict with int keys, "list", "tuple" or
"int-keys": the names join every path with "/", and import rebuilds those from it), so `torch.load(path, weights_only=True)` reads it without unpickling arbitrary objects. Names are
the manifest's keys ("model/0.weight"; naming.py, style "keys"); `only` / `exclude` / `strip_prefix`
/ `dtype` select, rename and cast as for the safetensors export. Tied weights are one tensor under
each of their keys (torch.save stores its bytes once), so the file loads into the model; a key the saving ranks held different tensors under is written once per
tensor ("key", "key#2", ...). Every chunk is verified on the way, as a restore would.

Unlike the safetensors export this is not streamed: torch.save writes one object, so the selected
tensors are all in memory (the source's bytes on disk bound what is allocated, see source.py). The
file is written under a temporary name and renamed; an existing file is refused unless `force`.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import torch

from checkpointing.errors import CheckpointConfigError, CheckpointError
from checkpointing.interop.naming import KeyPath, Named, container_kinds, name_tensors
from checkpointing.interop.source import export_path, open_step
from checkpointing.interop.types import Conversion, ExportResult
from checkpointing.storage import Storage


def export_torch(
    source: str | os.PathLike | Storage,
    out: str | os.PathLike,
    step: int | None = None,
    *,
    only: str | Iterable[str] | None = None,
    exclude: str | Iterable[str] | None = None,
    strip_prefix: str | None = None,
    dtype: str | torch.dtype | None = None,
    force: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    progress: Callable[[int], None] | None = None,
) -> ExportResult:
    """Write step `step` (default: the newest committed) of the checkpoint at `source` to the file `out`.

    The arguments are export_safetensors's (checkpointing.interop), less max_shard_size.
    """
    conv = Conversion.of(only, exclude, strip_prefix, dtype)
    opened = open_step(source, step, storage_options=storage_options)
    path = export_path(out, opened.storage)
    if path.is_dir():
        raise CheckpointConfigError(f"{path} is a directory: the torch export writes one file (--out FILE)")
    if path.exists() and not force:
        raise CheckpointConfigError(f"{path} exists: pass --force (force=True) to replace it, or choose another file")
    tensors: dict[str, torch.Tensor] = {}
    nbytes = 0
    named = name_tensors(opened.manifest, conv, "keys")
    for n in named:
        t = conv.cast(opened.read(n.entry))
        tensors[n.name] = t
        for alias in n.aliases:  # a tied weight: the same tensor, which torch.save stores once
            tensors[alias] = t
        nbytes += t.numel() * t.element_size()
        if progress is not None:
            progress(1)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    try:
        try:
            f = open(tmp, "xb")
        except OSError as exc:
            raise CheckpointConfigError(f"cannot write {path}: {exc.strerror or exc}; choose another --out (out=)") from None
        with f:
            try:
                torch.save({"step": opened.step, "world_size": opened.manifest.world_size, "tensors": tensors,
                            "layout": layout(named, container_kinds(opened.manifest))}, f)
            except RuntimeError as exc:  # torch's writer wraps the file's errors (a full disk)
                raise CheckpointError(f"writing {path} failed: {exc}") from None
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return ExportResult(opened.step, (str(path),), len(named), nbytes, {a: n.name for n in named for a in n.aliases})


def layout(named: list[Named], kinds: dict[KeyPath, str]) -> dict[str, str]:
    """Written name prefix ("optim/state") -> the kind of container saved there (naming.container_kinds). A name
    strip_prefix shortened by whole segments maps past them; the container holding a name's first segment is the
    file's own dict."""
    out: dict[str, str] = {}
    for n in named:
        segments = n.name.split("/")
        cut = len(n.path) - n.dropped - len(segments)  # whole segments strip_prefix removed
        if cut < 0:
            continue
        for i in range(1, len(segments)):
            kind = kinds.get(n.path[:n.dropped + cut + i])
            if kind is not None:
                out["/".join(segments[:i])] = kind
    return out
