"""A committed step opened read-only for a conversion, and each of its tensors read whole, verified (layer: interop).

The step may be on any tier: a checkpoint directory (opened read-only: no TIER file, no lock, nothing
created), a URL (s3://, file://, memory://; credentials from `storage_options` or the environment),
or a Storage the caller opened (the CLI). A tier with a TIER id reads the copies on that tier
(shards only other ranks' local tiers hold are named in the error); one without (a remote tier, a
copy of one) reads every primary copy.

Memory is bounded by what is on disk: before anything is allocated, every chunk this tier holds
must lie inside its file's real size, and the step's tensors together may not exceed the bytes of
the data files present, so a damaged manifest cannot make a conversion allocate more than that.
A tensor is read whole: the saved shards of a sharded state (FSDP, tensor parallel, any mesh) are
merged into the full tensor; every chunk is checked against its digest on the way.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Mapping

import torch

from checkpointing.errors import CheckpointConfigError, CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from checkpointing.format.dtypes import dtype_from_name
from checkpointing.format.manifest import Manifest, TensorEntry
from checkpointing.restore.load import open_readonly
from checkpointing.restore.reading import ReadBox, Sources, read_box
from checkpointing.storage import LocalStorage, Storage
from checkpointing.tier import catalog
from checkpointing.tier.identity import tier_id_of
from checkpointing.tier.verify import in_short, missing_files

@dataclasses.dataclass(frozen=True)
class OpenStep:
    """One committed step of one tier, ready to be read tensor by tensor."""

    storage: Storage
    step: int
    manifest: Manifest
    sources: Sources

    def read(self, entry: TensorEntry) -> torch.Tensor:
        """The full tensor of `entry` (its shards merged), every chunk verified."""
        full = torch.empty(entry.shape, dtype=dtype_from_name(entry.dtype))
        read_box(self.sources, self.step, ReadBox(entry, full, (0,) * len(entry.shape), entry.shape))
        return full


def open_step(source: str | os.PathLike | Storage, step: int | None = None, *, storage_options: Mapping[str, Any] | None = None, what: str = "export") -> OpenStep:
    """Step `step` (default: the newest committed) of the checkpoint at `source` (a directory, a URL or a Storage)."""
    storage = open_source(source, storage_options)
    committed = catalog.list_steps(storage).committed
    if not committed:
        raise CheckpointNotFoundError(f"{storage.url} holds no committed step")
    if step is None:
        step = committed[-1]
    elif step not in committed:
        shown = ", ".join(map(str, committed[-10:])) + (f" and {len(committed) - 10} older" if len(committed) > 10 else "")
        raise CheckpointNotFoundError(f"step {step} is not committed in {storage.url} (committed: {shown})")
    manifest = catalog.load_manifest(storage, step)
    here = tier_id_of(storage)
    if here is None:  # a remote tier (or a directory that never held a writer's TIER id): every primary copy
        sources = Sources(manifest, None, "", remote=storage)
    else:
        sources = Sources(manifest, storage, here, where=f" ({what} reads the tier {storage.url}; its other shards are on "
                                                         "other ranks' local tiers: read the remote tier, or a directory that holds every rank's files)")
    check_extent(storage, manifest)
    return OpenStep(storage, step, manifest, sources)


def open_source(source: str | os.PathLike | Storage, storage_options: Mapping[str, Any] | None = None) -> Storage:
    """A Storage as it is; a URL opened with `storage_options`; a directory opened read-only (it must exist)."""
    if not isinstance(source, (str, os.PathLike)):
        if storage_options:
            raise CheckpointConfigError("storage_options apply to a URL source, not to a storage already opened")
        return source
    return open_readonly(source, storage_options)


def check_extent(storage: Storage, manifest: Manifest) -> None:
    """Refuse, before any allocation, a manifest that promises more bytes than this tier's files hold."""
    try:
        found = storage.sizes(sorted(manifest.data_files()))  # an object store lists each directory
    except (CheckpointError, OSError) as exc:
        raise CheckpointCorruptError(f"step {manifest.step}: the data files in {storage.url} cannot be read ({exc})") from None
    sizes = {path: n for path, n in found.items() if n is not None}  # missing: on another tier, or missing (reading the shard says which)
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
    lost = missing_files(storage, manifest, found)
    if lost:
        raise CheckpointCorruptError(f"step {manifest.step}: {in_short(lost)}; "
                                     "export another step, or from another tier that holds this one (`checkpointing verify` checks every byte)")
    if manifest.nbytes > sum(sizes.values()):
        raise CheckpointCorruptError(
            f"step {manifest.step}: its tensors need {manifest.nbytes} bytes, but the data files in {storage.url} hold only "
            f"{sum(sizes.values())}: the manifest is damaged, or the step's files are on other tiers (export from the remote tier)"
        )


def export_path(out: str | os.PathLike, source: Storage) -> Path:
    """`out` as the local path an export writes: refused where it is a URL, or where it lies inside the
    checkpoint being read (followed through links): an export never writes into a tier."""
    text = os.fspath(out)
    if "://" in text:
        raise CheckpointConfigError(f"--out {text}: an export is written to a local path (a file for --format torch, a directory "
                                    "for safetensors); write it locally, then copy it where it should go")
    root = source.root if isinstance(source, LocalStorage) else \
        getattr(source, "root", None) if getattr(source, "protocol", None) in ("file", "local") else None
    if root is not None:
        real_root, real_out = Path(os.path.realpath(root)), Path(os.path.realpath(text))
        if real_out == real_root or real_root in real_out.parents:
            raise CheckpointConfigError(f"--out {text} lies inside the checkpoint directory {real_root} being exported: "
                                        "an export never writes into a checkpoint (it could replace its files); choose a path outside it")
    return Path(text)
