"""The TIER file: the identity of a local tier, a random id stored in its root once (I/O).

Ranks that read the same id share the tier (a node-local directory). The remote tier has none.
"""

from __future__ import annotations

import secrets

from checkpointing.errors import CheckpointError
from checkpointing.storage import Storage

TIER_FILE = "TIER"


def read_tier_id(storage: Storage) -> str | None:
    """The id stored in `storage`, or None for a tier without one (remote: every primary copy)."""
    try:
        return storage.get(TIER_FILE, max_bytes=4096).decode("ascii").strip()
    except (FileNotFoundError, UnicodeDecodeError):
        return None


def ensure_tier_id(storage: Storage) -> str:
    """The tier's id, created first when it has none (ranks sharing the tier race: one create wins)."""
    found = read_tier_id(storage)
    if found is not None:
        return found
    try:
        storage.put(TIER_FILE, secrets.token_hex(8).encode("ascii"), exclusive=True)
    except FileExistsError:  # another rank on this tier created it first
        pass
    try:
        return storage.get(TIER_FILE, max_bytes=4096).decode("ascii").strip()
    except (FileNotFoundError, UnicodeDecodeError) as exc:  # a link there (never followed), or not an id
        raise CheckpointError(f"{storage.url}/{TIER_FILE} cannot be read as the tier's id ({exc}): remove it") from None
