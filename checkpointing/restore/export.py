"""Export a committed step as one file of full (unsharded) tensors, for tools that do not read our format (layer: restore).

The file is written with torch.save and holds only tensors, strings and ints:
    {"step": N, "world_size": W, "tensors": {key: full tensor, ...}}
so `torch.load(path, weights_only=True)` reads it without unpickling arbitrary objects. Every
chunk is verified on the way, as a restore would. Memory is bounded by what is on disk: before
anything is allocated, every chunk this tier holds must lie inside its file's real size, and the
full tensors together may not exceed the bytes of the data files present.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import torch

from checkpointing.errors import CheckpointCorruptError, CheckpointError
from checkpointing.format.manifest import Manifest
from checkpointing.tier import catalog
from checkpointing.format.dtypes import dtype_from_name
from checkpointing.restore.reading import ReadBox, Sources, read_box
from checkpointing.storage import Storage
from checkpointing.tier.tierfile import read_tier_id


def export_step(storage: Storage, step: int, out: str | os.PathLike, *, progress: Callable[[int], None] | None = None) -> int:
    """Write step `step` of the tier `storage` to `out`; returns the bytes of tensor data written.

    On a local tier, shards that only other ranks' local tiers hold cannot be read: that raises
    CheckpointError naming the file (export from the remote tier, or from a shared directory).
    """
    manifest = catalog.load_manifest(storage, step)
    here = read_tier_id(storage)
    if here is None:  # a remote tier: every primary copy
        sources = Sources(manifest, None, "", remote=storage)
    else:
        sources = Sources(manifest, storage, here, where=f" (export reads the tier {storage.url}; its other shards are on other ranks' local tiers)")
    _check_extent(storage, manifest)
    tensors = {}
    nbytes = 0
    for entry in manifest.tensors:
        full = torch.empty(entry.shape, dtype=dtype_from_name(entry.dtype))
        read_box(sources, step, ReadBox(entry, full, (0,) * len(entry.shape), entry.shape))
        key = entry.key
        n = 2
        while key in tensors:  # per-rank tensors share a key: keep each, numbered
            key, n = f"{entry.key}#{n}", n + 1
        tensors[key] = full
        nbytes += entry.nbytes
        if progress is not None:
            progress(1)
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    torch.save({"step": step, "world_size": manifest.world_size, "tensors": tensors}, tmp)
    os.replace(tmp, out)
    return nbytes


def _check_extent(storage: Storage, manifest: Manifest) -> None:
    """Refuse, before any allocation, a manifest that promises more bytes than this tier's files hold."""
    sizes: dict[str, int] = {}
    for path in sorted(manifest.data_files()):
        try:
            sizes[path] = storage.size(path)
        except FileNotFoundError:
            continue  # on another tier, or missing: reading the shard says which
        except (CheckpointError, OSError) as exc:
            raise CheckpointCorruptError(f"step {manifest.step}: data file {storage.url}/{path} cannot be read ({exc})") from None
    for entry in manifest.tensors:
        for shard in entry.shards:
            for copy in shard.copies():
                for c in copy:
                    if c.file in sizes and c.offset + c.length > sizes[c.file]:
                        raise CheckpointCorruptError(
                            f"step {manifest.step}, tensor {entry.key!r:.120}: bytes {c.offset}..{c.offset + c.length} of "
                            f"{storage.url}/{c.file} lie past its end ({sizes[c.file]} bytes): the file is truncated or the "
                            "manifest damaged; export another step"
                        )
    if manifest.nbytes > sum(sizes.values()):
        raise CheckpointCorruptError(
            f"step {manifest.step}: its tensors need {manifest.nbytes} bytes, but the data files in {storage.url} hold only "
            f"{sum(sizes.values())}: the manifest is damaged, or the step's files are on other tiers (export from the remote tier)"
        )
