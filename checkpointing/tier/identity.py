"""A writing manager's local tier id at start-up (I/O): the TIER file's; when that file was lost or
damaged, the id the committed steps' files there were written under; else a new one.

The id decides which shards a rank reads from its own disk (a manifest names each file's tier). A
new random id for a directory whose TIER file was deleted, or had a bit flipped, would make every
step committed there look like another node's: unreadable locally, and "verified" as living
elsewhere. So the id is recovered first: from the newest committed steps, the ids of the files
present there with their sizes; exactly one id among them is this directory's. Ranks of one tier
that race here recover the same id, and one exclusive create wins.
"""

from __future__ import annotations

import logging
import secrets

from checkpointing.errors import CheckpointConfigError, CheckpointError
from checkpointing.storage import LocalStorage, Storage
from checkpointing.tier import catalog
from checkpointing.tier.opening import ReadOnlyLocalStorage
from checkpointing.tier.tierfile import TIER_FILE, read_tier_id

log = logging.getLogger("checkpointing")

LOOK_AT = 3  # newest committed steps whose files are looked at


def ensure_tier_id(storage: Storage) -> str:
    """The tier's id, created first when it has none, written again when the committed steps' files
    there name another. A tier opened read-only (opening.py) is read as `tier_id_of` says ("": as
    holding every primary copy); nothing is written there."""
    if isinstance(storage, ReadOnlyLocalStorage):
        return tier_id_of(storage) or ""
    found = read_tier_id(storage)
    recovered = _from_committed_steps(storage)
    if found is None and _exists(storage):  # another rank of this tier may have created it just now (an atomic put)
        found = read_tier_id(storage)
    if found is not None and recovered in (None, found):
        return found
    try:
        _write_id(storage, recovered)
    except OSError as exc:  # not writable, a full disk: no TIER file, and the manager cannot start there
        raise CheckpointConfigError(f"cannot use {storage.url} as the checkpoint directory: writing its {TIER_FILE} file failed "
                                    f"({exc}); it must be a directory this process can write, on a filesystem with free "
                                    "space; to only read the checkpoints there, open CheckpointManager(dir, read_only=True)") from exc
    found = read_tier_id(storage)
    if found is None:  # a link there (never followed), or not an id, and no committed step names one
        raise CheckpointError(f"{storage.url}/{TIER_FILE} cannot be read as the tier's id, and no committed step there "
                              "names one: remove it (the directory then gets a new id)")
    return found


def _write_id(storage: Storage, recovered: str | None) -> None:
    """Write the TIER file: `recovered` (the committed steps' id) over a lost or damaged one, else a new id."""
    if recovered is not None:  # missing, not an id, or an id no file here names: the files' id again
        log.warning("checkpointing: %s/%s was %s; the committed steps' files there name the id %s, which it gets again",
                    storage.url, TIER_FILE, "damaged" if _exists(storage) else "missing", recovered)
        storage.delete(TIER_FILE)  # ranks of this tier that race here all write the same id
    try:
        storage.put(TIER_FILE, (recovered or secrets.token_hex(8)).encode("ascii"), exclusive=True)
    except FileExistsError:  # another rank on this tier created it first (or a TIER file that is not an id)
        pass


def tier_id_of(storage: Storage) -> str | None:
    """The id to read `storage` as (nothing is written): the id its committed steps' files there were
    written under when its TIER file is missing, damaged or names none of them, else the TIER file's
    (None: a tier with every primary copy, such as the remote tier: never a local tier's id)."""
    if not isinstance(storage, LocalStorage):
        return read_tier_id(storage)
    recovered = _from_committed_steps(storage)
    return recovered if recovered is not None else read_tier_id(storage)


def _exists(storage: Storage) -> bool:
    try:
        storage.size(TIER_FILE)
    except FileNotFoundError:
        return False
    except (OSError, CheckpointError):
        return True
    return True


def _from_committed_steps(storage: Storage) -> str | None:
    """The one tier id the newest committed steps' files present here (with their sizes) were written under."""
    try:
        steps = catalog.list_steps(storage).committed[-LOOK_AT:]
    except (OSError, CheckpointError):
        return None
    for step in reversed(steps):
        try:
            manifest, _ = catalog.committed_manifest(storage, step)
        except (OSError, CheckpointError):
            continue
        ids = {f.tier for f in manifest.files if f.tier and storage.exists_with_size(f.path, f.nbytes)}
        if len(ids) == 1:
            return ids.pop()
    return None
