"""`checkpointing.load()`: a committed step as a fresh dict, with no model built first (layer: restore).

Read-only: it opens the directory or URL without creating anything (no TIER file, no lock, no
tidying) and reads only the chunks of the selected keys, each verified. Objects saved through
state_dict() come back as their state dicts; sharded tensors come back whole; values the saving
ranks held per rank (an RNG state) come back for one named rank, or are refused by key.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

from checkpointing.errors import (CheckpointConfigError, CheckpointCorruptError, CheckpointError, CheckpointMismatchError,
                                  CheckpointNotFoundError, about_step)
from checkpointing.format import naming
from checkpointing.format.manifest import Manifest
from checkpointing.restore.planner import Sources, execute, plan_restore
from checkpointing.restore.selection import Selection
from checkpointing.restore.step_choice import listing
from checkpointing.state.codecs import Codec, codec_tuple
from checkpointing.storage import Storage, open_storage
from checkpointing.storage.redact import redact_url
from checkpointing.tier import catalog
from checkpointing.tier.opening import ReadOnlyLocalStorage, refuse_foreign
from checkpointing.tier.identity import tier_id_of

log = logging.getLogger("checkpointing")


def load(
    path_or_url: str | os.PathLike,
    step: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
    *,
    keys: str | Iterable[str] | None = None,
    exclude: str | Iterable[str] | None = None,
    rank: int | None = None,
    codecs: Iterable[Codec] = (),
) -> dict[str, Any]:
    """Step `step` (default: the newest committed) of the checkpoint at `path_or_url` as a nested dict.

    keys / exclude: glob patterns over keys as the manifest names them ("model", "model/*",
    "optim/state/*/exp_avg"); only the selected tensors' bytes are read. rank: for a checkpoint saved
    by several ranks, read the values each rank saved for itself (per-rank values) as rank `rank`
    saved them; without it such values are refused by key (sharded and replicated tensors need no
    rank: they come back whole). codecs: the Codec objects values were saved with.
    """
    naming.check_step(step, optional=True)
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise CheckpointConfigError(f"rank={rank!r} is invalid: pass the int rank whose per-rank values to read")
    storage = open_readonly(path_or_url, storage_options)
    committed = catalog.list_steps(storage).committed
    if not committed:
        raise CheckpointNotFoundError(f"{storage.url} holds no committed step")
    if step is not None:
        if step not in committed:
            raise CheckpointNotFoundError(f"step {step} is not committed in {storage.url} (committed: {listing(committed)})")
        return _read(storage, catalog.load_manifest(storage, step), keys, exclude, rank, codecs)
    newer: list[int] = []
    while True:  # the newest step that reads clean: one whose data is damaged is passed over, as restore() does
        manifest = _newest_readable(storage, [s for s in committed if not newer or s < newer[-1]])
        try:
            return _read(storage, manifest, keys, exclude, rank, codecs)
        except CheckpointCorruptError as exc:
            if not any(s < manifest.step for s in committed):
                raise
            log.warning("checkpointing: load() passes over step %d of %s, its data is damaged: %s", manifest.step, storage.url, exc)
            newer.append(manifest.step)


def _read(storage: Storage, manifest: Manifest, keys: str | Iterable[str] | None, exclude: str | Iterable[str] | None,
          rank: int | None, codecs: Iterable[Codec]) -> dict[str, Any]:
    """The selected part of the step `manifest` describes, read and verified."""
    step = manifest.step
    if rank is not None and not 0 <= rank < manifest.world_size:
        raise CheckpointConfigError(f"rank={rank}: step {step} was saved by {manifest.world_size} rank(s) (0..{manifest.world_size - 1})")
    select = Selection.of(True, keys, exclude, take_all=True)
    world = manifest.world_size if rank is not None else 1
    try:
        plan = plan_restore({}, manifest, rank=rank or 0, world_size=world, codecs=codec_tuple(codecs), select=select)
    except CheckpointMismatchError as exc:  # worded for load(): there is no state passed to restore
        raise CheckpointMismatchError(exc.step, exc.problems, load=True) from None
    here = tier_id_of(storage)
    if here is None:  # a remote tier (or a directory that never held a writer's TIER id): every primary copy
        sources = Sources(manifest, None, "", remote=storage)
    else:
        sources = Sources(manifest, storage, here, where=f" (load reads {storage.url}; its other shards are on other ranks' local tiers)")
    missing = plan.missing(sources)
    if missing:
        raise CheckpointError(
            f"step {step}: {len(missing)} shard(s) are not in {storage.url}, e.g. {missing[0]}: load from the remote tier, "
            "or from a directory that holds every rank's files"
        )
    state: dict[str, Any] = {}
    execute(plan, state, sources)
    return state


def _newest_readable(storage: Storage, committed: list[int]) -> Manifest:
    """The manifest of the newest committed step whose COMMIT and manifest read clean; a newer one that
    does not is passed over with a warning, as restore() does."""
    problems = []
    for s in sorted(committed, reverse=True):
        try:
            return catalog.load_manifest(storage, s)
        except (CheckpointCorruptError, CheckpointNotFoundError) as exc:
            problems.append(about_step(s, exc))
            log.warning("checkpointing: load() passes over step %d of %s: %s", s, storage.url, exc)
    raise CheckpointCorruptError(f"no committed step in {storage.url} can be read: {'; '.join(problems)}; "
                                 "checkpointing verify names what is damaged")


def open_readonly(path_or_url: str | os.PathLike, storage_options: Mapping[str, Any] | None) -> Storage:
    """A URL opened with `storage_options`; a directory opened read-only (it must exist; nothing is created)."""
    target = os.fspath(path_or_url)
    if not target:  # an unset variable: never the current directory
        raise CheckpointConfigError(f"path_or_url={path_or_url!r} is empty: pass the checkpoint directory or URL")
    if "://" in target:
        return open_storage(target, storage_options)
    target = os.path.expanduser(target)
    if storage_options:
        raise CheckpointConfigError(f"storage_options apply to URLs such as s3://bucket/path, not to the directory {target!r}")
    if Path(target).is_file():
        raise CheckpointNotFoundError(f"{redact_url(target)} is a file: load() reads a checkpoint directory; a torch.save file comes in as "
                                    f"a step with `checkpointing import {target} NEW_DIR` (checkpointing.interop.import_checkpoint)")
    if not Path(target).is_dir():
        raise CheckpointNotFoundError(f"{redact_url(target)}: no such checkpoint directory")
    refuse_foreign(target, CheckpointNotFoundError)
    return ReadOnlyLocalStorage(target)  # refuses any write: load() changes nothing
