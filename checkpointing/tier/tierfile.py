"""The TIER file: the identity of a local tier, a random id stored in its root once (I/O).

Ranks that read the same id share the tier (a node-local directory). The remote tier has none, and
neither has a directory no writing manager opened (a read-only manager creates none: opening.py).
"""

from __future__ import annotations

import re

from checkpointing.errors import CheckpointError
from checkpointing.storage import Storage

TIER_FILE = "TIER"
_ID = re.compile(r"[0-9a-f]{8,64}")  # secrets.token_hex(8) makes 16


def read_tier_id(storage: Storage) -> str | None:
    """The id stored in `storage`, or None for a tier without one (remote: every primary copy), or
    whose TIER file is not an id (damaged: read as holding every primary copy; identity.py recovers it)."""
    try:
        found = storage.get(TIER_FILE, max_bytes=4096).decode("ascii").strip()
    except (FileNotFoundError, UnicodeDecodeError):
        return None
    except (OSError, CheckpointError):  # a directory or a link there
        return None
    return found if _ID.fullmatch(found) else None
