"""The temporaries a killed writer left at a tier's root (I/O: one listing).

Every put of a file at the root (`TIER`, `metrics.jsonl`, an integration's records) writes
`<name>.tmp-<token>` first and renames it over the name (storage/local.py, storage/remote.py on
file://); a process killed in between leaves the temporary, which no step names. `checkpointing gc`
and a writer's tidying at start (tier/collect.py) remove those old enough to be nobody's in flight.
"""

from __future__ import annotations

import re

from checkpointing.storage import Storage

_TEMPORARY = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*\.tmp-[0-9a-f]{12}")


def root_temporaries(storage: Storage) -> list[str]:
    """The names at the root of `storage` that are a put's temporaries."""
    return [name for name in storage.list("") if _TEMPORARY.fullmatch(name)]
