"""What holds a tier's files (I/O), as the collector reads it (collect.py): the pins of the saves in flight
in the uncommitted step directories (G3), and the manifests of the committed steps (G4)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Collection

from checkpointing.errors import CheckpointError, ManifestError, about_step
from checkpointing.format import naming
from checkpointing.storage import Storage
from checkpointing.tier import catalog
from checkpointing.tier.pins import PIN_PREFIX, read_pin


@dataclasses.dataclass(frozen=True)
class Pins:
    """What G3 found in the uncommitted step directories."""

    live: frozenset[str]  # files the pins that hold name
    pinned: list[int]  # steps a save in flight holds (a pin that holds, or `protect`)
    dead: dict[int, list[str]]  # step -> its crashed writers' pins
    problems: list[str]


@dataclasses.dataclass(frozen=True)
class Refs:
    """What G4 found in the committed steps' manifests."""

    live: frozenset[str]  # files they reference
    own: dict[int, set[str]]  # committed step -> the names it owns (files, COMMIT, manifest)
    problems: list[str]


def read_pins(storage: Storage, uncommitted: list[int], protect: Collection[int], dead_pin: Callable[[str], bool]) -> Pins:
    """G3: the pins in each uncommitted step directory; a crashed writer's pin holds nothing."""
    live: set[str] = set()
    problems: list[str] = []
    pinned: list[int] = []
    dead: dict[int, list[str]] = {}
    for s in uncommitted:
        sdir = naming.step_dir(s)
        pins = [f"{sdir}/{n}" for n in storage.list(sdir) if n.startswith(PIN_PREFIX)]
        holds = s in protect
        for pin in pins:
            if s not in protect and dead_pin(pin):
                dead.setdefault(s, []).append(pin)
                continue
            holds = True
            try:
                live.update(read_pin(storage, pin))
            except (ManifestError, FileNotFoundError) as exc:
                if not isinstance(exc, FileNotFoundError):  # gone meanwhile: its save committed or failed
                    problems.append(about_step(s, exc))
        if holds:
            pinned.append(s)
    return Pins(frozenset(live), pinned, dead, problems)


def read_manifests(storage: Storage, *, skip: Collection[int]) -> Refs:
    """G4: the committed steps, listed again (a step that committed and dropped its pin since G2 is
    read here), and what their manifests reference. `skip`: steps a dry run pretends were retired."""
    live: set[str] = set()
    own: dict[int, set[str]] = {}
    problems: list[str] = []
    for s in catalog.list_steps(storage).committed:
        if s in skip:
            continue
        try:
            marker = catalog.read_commit(storage, s)
            manifest = catalog.load_manifest(storage, s)
        except CheckpointError as exc:
            problems.append(about_step(s, exc))
            continue
        files = {f.path for f in manifest.files} | manifest.data_files()
        live |= files
        own[s] = files | {naming.commit_name(s), marker.manifest}
    return Refs(frozenset(live), own, problems)
