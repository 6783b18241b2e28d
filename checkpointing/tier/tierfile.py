"""The TIER file: the identity of a local tier, a random id stored in its root once (I/O).

Ranks that read the same id share the tier (a node-local directory). The remote tier has none, and
neither has a directory no writing manager opened (a read-only manager creates none: opening.py).
"""

from __future__ import annotations

import secrets

from checkpointing.errors import CheckpointError
from checkpointing.storage import Storage
from checkpointing.tier.opening import ReadOnlyLocalStorage

TIER_FILE = "TIER"


def read_tier_id(storage: Storage) -> str | None:
    """The id stored in `storage`, or None for a tier without one (remote: every primary copy)."""
    try:
        return storage.get(TIER_FILE, max_bytes=4096).decode("ascii").strip()
    except (FileNotFoundError, UnicodeDecodeError):
        return None


def ensure_tier_id(storage: Storage) -> str:
    """The tier's id, created first when it has none (ranks sharing the tier race: one create wins).
    A tier opened read-only (opening.py) gets none created: "" (read as holding every primary copy)."""
    found = read_tier_id(storage)
    if found is not None:
        return found
    if isinstance(storage, ReadOnlyLocalStorage):
        return ""
    try:
        storage.put(TIER_FILE, secrets.token_hex(8).encode("ascii"), exclusive=True)
    except FileExistsError:  # another rank on this tier created it first
        pass
    try:
        return storage.get(TIER_FILE, max_bytes=4096).decode("ascii").strip()
    except (FileNotFoundError, UnicodeDecodeError) as exc:  # a link there (never followed), or not an id
        raise CheckpointError(f"{storage.url}/{TIER_FILE} cannot be read as the tier's id ({exc}): remove it") from None
