"""Pins: a save in flight marks its step, and the earlier files it may take chunks from (I/O).

The writer's half of the collection protocol in collect.py (docs/format.md, "Pins and garbage
collection"): W1 pin the step before creating any file there, W2 confirm the base step is still
committed, remove the pin once the step committed or failed. Collectors read pins (G3).
"""

from __future__ import annotations

import json
import logging
from typing import Iterable

from checkpointing.errors import ManifestError
from checkpointing.format import naming
from checkpointing.format.manifest import FORMAT_VERSION, canonical_json
from checkpointing.storage import Storage
from checkpointing.tier import catalog

log = logging.getLogger("checkpointing")

PIN_PREFIX = "PIN."


def pin_name(step: int, rank: int, token: str) -> str:
    return f"{naming.step_dir(step)}/{PIN_PREFIX}r{rank:05d}.{token}.json"


def write_pin(storage: Storage, step: int, rank: int, token: str, files: Iterable[str]) -> str:
    """Pin `step` for a save in flight that may take chunks from `files`; returns the pin's path."""
    path = pin_name(step, rank, token)
    # not fsynced: a pin protects files from collectors running now; after a power cut its save is dead anyway
    storage.put(path, canonical_json({"format_version": FORMAT_VERSION, "step": step, "rank": rank, "files": sorted(files)}),
                durable=False)
    return path


def remove_pin(storage: Storage, path: str | None) -> None:
    if path is None:
        return
    try:
        storage.delete(path)
    except OSError as exc:  # a stale pin only delays collection; the writer removes it when it restarts
        log.warning("checkpointing: could not remove the pin %s/%s: %s", storage.url, path, exc)


def pins_in(storage: Storage, steps: Iterable[int]) -> dict[int, list[str]]:
    """The pins in each step's directory (paths), where there are any."""
    out: dict[int, list[str]] = {}
    for step in steps:
        sdir = naming.step_dir(step)
        found = [f"{sdir}/{n}" for n in storage.list(sdir) if n.startswith(PIN_PREFIX)]
        if found:
            out[step] = found
    return out


def remove_failed_step_dir(storage: Storage, step: int) -> None:
    """After a failed save removed its files and its pin: the step's directory, if it is one and
    nothing is left in it (another rank's files, or a committed step's, keep it). Collectors leave
    an empty step directory alone for a while (a writer's, about to be pinned: collect.py); its
    own writer knows it is done with it. A file of that name is not touched."""
    path = naming.step_dir(step)
    if catalog.plain_object(storage, path) is False:  # a directory (or gone); an object of that name this save did not make
        storage.remove_dir(path)


def read_pin(storage: Storage, path: str) -> list[str]:
    """The files a pin protects; ManifestError when it cannot be read (then nothing may be collected)."""
    where = f"{storage.url}/{path}"
    try:
        obj = json.loads(storage.get(path))
        files = obj["files"]
        if not isinstance(files, list):
            raise TypeError("files is not a list")
        return [naming.check_relpath(f, what=f"{where}: file") for f in files]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise ManifestError(f"pin {where} is unreadable ({type(exc).__name__}: {exc})") from None


def still_committed(storage: Storage, step: int, manifest_digest: str) -> bool:
    """Is `step` committed with the manifest whose sha256 is `manifest_digest`? (W2 of the protocol)"""
    return catalog.committed_digest(storage, step) == manifest_digest
