"""The temporaries a killed writer left at a tier's root (I/O: one listing).

A put of a file at the root (`TIER`, `metrics.jsonl`, and the Lightning plugin's
`lightning-released.json` and `lightning-dirs.json`) writes `<name>.tmp-<token>` first and renames
it over the name (storage/local.py, storage/remote.py on file://); a process killed in between
leaves the temporary, which no step names. `checkpointing gc` and a writer's tidying at start
(tier/collect.py) remove those old enough to be nobody's in flight (PUT_GRACE_S, or the collector's
min_age_s if longer: a put takes far less, and another process may be making one, a manager opening
beside a collector: its TIER): regular files of exactly those names only, never a directory, a link
or a user's file that merely looks like one.
"""

from __future__ import annotations

import re

from checkpointing.format.naming import METRICS_NAME
from checkpointing.storage import Storage
from checkpointing.tier.tierfile import TIER_FILE

# the names puts write at a tier's root: the integrations' by their literal names (they sit above this layer)
PUT_AT_ROOT = (TIER_FILE, METRICS_NAME, "lightning-released.json", "lightning-dirs.json")
_TEMPORARY = re.compile("(" + "|".join(map(re.escape, PUT_AT_ROOT)) + r")\.tmp-[0-9a-f]{12}")


PUT_GRACE_S = 60.0  # a temporary younger than this may be a put in flight in another process


def stale(age_s: float | None, min_age_s: float) -> bool:
    """A temporary this old (None: unknown) is no put's in flight any more."""
    return age_s is not None and age_s >= max(min_age_s, PUT_GRACE_S)


def root_temporaries(storage: Storage) -> list[str]:
    """The names at the root of `storage` that are a put's temporaries: regular files (a directory, or a
    prefix on an object store, has no size; a link is not listed)."""
    named = [name for name in storage.list("") if _TEMPORARY.fullmatch(name)]
    return [name for name, size in storage.sizes(named).items() if size is not None] if named else []
