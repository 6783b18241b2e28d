"""The directories below a prefix and the names in each, at once (layer: storage, I/O): what listing a tier's
steps needs (tier/catalog.list_steps: every step directory, and whether its COMMIT is there).

A listing is one request per directory on an object store, and a tier that keeps every step holds
thousands of them: restore, start-up and `checkpointing ls` each listed them one by one. An object
store lists every key below a prefix 1,000 a request instead, so the keys are listed once and
grouped by their first segment. Elsewhere (a directory of this machine) each directory is listed.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable


def grouped(keys: Iterable[str], only: Callable[[str], bool]) -> dict[str, list[str]]:
    """From every key below a prefix (relative to it): each first segment `only` takes -> the names directly in it
    (an object of that name with nothing below it: an empty list)."""
    out: dict[str, set[str]] = {}
    for key in keys:
        head, _, rest = key.partition("/")
        if only(head):
            names = out.setdefault(head, set())
            if rest:
                names.add(rest.split("/", 1)[0])
    return {head: sorted(names) for head, names in sorted(out.items())}


def dir_by_dir(storage: Any, prefix: str, only: Callable[[str], bool]) -> dict[str, list[str]]:
    """Storage.list_dirs from `list`: the names in `prefix` that `only` takes, each listed (a file lists nothing)."""
    return {name: storage.list(f"{prefix}/{name}" if prefix else name) for name in storage.list(prefix) if only(name)}
