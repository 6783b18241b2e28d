"""Reference-safe deletion on one tier: retention, incomplete steps, `checkpointing gc` (I/O).

An incremental save's manifest references chunks in earlier steps' files, so deleting a step is
two things: retiring it (its COMMIT goes, so nobody restores it) and collecting the files that no
committed step and no save in flight needs any more. The protocol (docs/format.md, "Pins and
garbage collection") in short:

- a writer pins its step before it creates any file there or refers to any earlier file: a pin
  (step-N/PIN.r<rank>.<token>.json) names the earlier files it may take chunks from; it then
  confirms its base step is still committed (else it takes nothing), and removes the pin once the
  step is committed (its manifest protects the files from then on) or has failed;
- a collector (G1) removes the COMMIT of each step it retires, (G2) lists the files of every
  uncommitted step directory, (G3) reads the pins, (G4) lists the committed steps again and reads
  their manifests, and (G5) deletes the files listed in G2 that no pin and no manifest names, in
  directories nobody pins and that did not commit meanwhile.

Why it is safe: a file listed in G2 in a pinned directory was created after its pin (W1 before the
file), so G3 sees the pin, or the writer committed before G3 and G4 sees the step. A save whose pin G3 missed pinned after G3, so it confirmed its base
after G1: it either sees the base retired and takes nothing from it, or the base was not being
retired and G4 finds it committed, with every file it references.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import Callable, Collection, Iterable

from checkpointing.tier import catalog
from checkpointing.format import naming
from checkpointing.errors import CheckpointError, ManifestError
from checkpointing.format.manifest import FORMAT_VERSION, canonical_json
from checkpointing.storage import Storage
from checkpointing.tier.pins import PIN_PREFIX, read_pin

log = logging.getLogger("checkpointing")

@dataclasses.dataclass(frozen=True)
class Garbage:
    path: str
    nbytes: int
    reason: str


@dataclasses.dataclass
class Collected:
    retired: list[int]  # steps whose COMMIT this run removed (would remove, dry run)
    garbage: list[Garbage]  # files removed (would be removed, dry run)
    kept: dict[int, int]  # uncommitted step -> files left because committed steps still reference them
    pinned: list[int]  # uncommitted steps left alone: a save in flight pins them
    problems: list[str]  # what stopped the collection of data (nothing was deleted because of it)


def collect(
    storage: Storage,
    *,
    retire: Collection[int] = (),
    protect: Collection[int] = (),
    min_age_s: float = 0.0,
    pin_ttl_s: float | None = None,
    now: float | None = None,
    dry_run: bool = False,
    measure: bool = False,
    scan_committed: bool = True,
    on_delete: Callable[[Garbage], object] | None = None,
) -> Collected:
    """Retire the committed steps `retire`, then remove every file on the tier that nothing needs.

    `protect`: steps the caller has in flight (left alone whether pinned yet or not). Files younger
    than `min_age_s` are left alone (they may belong to a writer that pins nothing: needs mtime()).
    A pin older than `pin_ttl_s` is taken for a crashed writer's (None: every pin holds).
    `measure`: report sizes (one request per file on object stores). `scan_committed`: also
    remove files inside committed steps' directories that nothing references (stale pins, a losing
    writer's files, temporaries); retention after a save skips that scan.
    """
    now = time.time() if now is None else now
    mtime = getattr(storage, "mtime", None)

    def age(path: str) -> float | None:
        if mtime is None:
            return None
        try:
            return now - mtime(path)
        except (FileNotFoundError, OSError):
            return None

    def young(path: str) -> bool:
        a = age(path) if min_age_s > 0 else None
        return a is not None and a < min_age_s

    def dead(pin: str) -> bool:
        """A crashed writer's pin: older than pin_ttl_s (with pin_ttl_s <= 0, every pin)."""
        if pin_ttl_s is None:
            return False
        a = age(pin) if pin_ttl_s > 0 else None
        return pin_ttl_s <= 0 or (a is not None and a > pin_ttl_s)

    # G1: retire
    retire = sorted(set(retire))
    if not dry_run:
        for step in retire:
            storage.delete(naming.commit_name(step))
    listing = catalog.list_steps(storage)
    committed = [s for s in listing.committed if not (dry_run and s in retire)]
    uncommitted = sorted(set(listing.incomplete) | (set(retire) & set(listing.committed) if dry_run else set()))
    out = Collected([s for s in retire if s in listing.committed] if dry_run else list(retire), [], {}, [], [])
    if not uncommitted and not scan_committed:
        return out  # nothing to collect: no manifest needs reading
    # G2: what is there now (files created later belong to writers that pinned first)
    names = {s: storage.list(naming.step_dir(s)) for s in uncommitted}
    # G3: pins
    live: set[str] = set()
    problems: list[str] = []
    pinned: list[int] = []
    dead_pins: dict[int, list[str]] = {}
    for s in uncommitted:
        sdir = naming.step_dir(s)
        pins = [f"{sdir}/{n}" for n in storage.list(sdir) if n.startswith(PIN_PREFIX)]
        holds = s in protect
        for pin in pins:
            if s not in protect and dead(pin):
                dead_pins.setdefault(s, []).append(pin)
                continue
            holds = True
            try:
                live.update(read_pin(storage, pin))
            except (ManifestError, FileNotFoundError) as exc:
                if not isinstance(exc, FileNotFoundError):  # gone meanwhile: its save committed or failed
                    problems.append(f"step {s}: {exc}")
        if holds:
            pinned.append(s)
    # G4: committed manifests, listed again: a step that committed (and dropped its pin) since G2 is read here
    now_committed = [s for s in catalog.list_steps(storage).committed if not (dry_run and s in retire)]
    own: dict[int, set[str]] = {}
    for s in now_committed:
        try:
            marker = catalog.read_commit(storage, s)
            manifest = catalog.load_manifest(storage, s)
        except CheckpointError as exc:
            problems.append(f"step {s}: {exc}")
            continue
        files = {f.path for f in manifest.files} | manifest.data_files()
        live |= files
        own[s] = files | {naming.commit_name(s), marker.manifest}
    committed = [s for s in committed if s in own]
    out.pinned, out.problems = pinned, problems
    if problems:  # a step we cannot read may reference anything: delete no data
        return out

    def drop(path: str, reason: str) -> None:
        nbytes = _size(storage, path) if measure else 0
        if not dry_run:
            storage.delete(path)
        out.garbage.append(Garbage(path, nbytes, reason))
        if on_delete is not None:
            on_delete(out.garbage[-1])

    # G5: delete what nothing needs
    for s in uncommitted:
        if s in pinned or s in own:  # pinned, or committed since G2
            continue
        sdir = naming.step_dir(s)
        reason = f"step {s} retired" if s in retire else "incomplete step (no COMMIT)"
        kept = 0
        ordered = sorted(names[s], key=lambda n: (not n.startswith("manifest."), not n.startswith(PIN_PREFIX), n))
        for n in ordered:
            path = f"{sdir}/{n}"
            if path in live or young(path):
                kept += path in live
                continue
            drop(path, reason if path not in dead_pins.get(s, ()) else "pin of a crashed save")
        if kept:
            out.kept[s] = kept
        elif not dry_run and not young(sdir):
            storage.remove_dir(sdir)
    for s in committed if scan_committed else ():
        if s not in own:
            continue
        sdir = naming.step_dir(s)
        for n in storage.list(sdir):
            path = f"{sdir}/{n}"
            if n.startswith(PIN_PREFIX) and not dead(path):
                continue  # its writer committed and is about to remove it
            if path not in own[s] and path not in live and not young(path):
                drop(path, "not referenced by the step's manifest")
    return out


def apply_retention(storage: Storage, keep: int | None, *, protect: int | Collection[int] | None = None,
                    in_flight: Collection[int] = ()) -> list[int]:
    """Retire committed steps beyond the newest `keep` (never those in `protect`) and collect what
    they alone referenced; returns the retired steps. `in_flight`: this process's saves in flight."""
    from checkpointing.plan.retention import steps_to_delete

    if keep is None:
        return []
    doomed = steps_to_delete(catalog.list_steps(storage).committed, keep, protect=protect)
    if not doomed:
        return []
    try:
        result = collect(storage, retire=doomed, protect=in_flight, scan_committed=False)
    except OSError as exc:  # one failed delete must not stop training; retried after the next save
        log.warning("checkpointing: could not delete steps %s from %s: %s", doomed, storage.url, exc)
        return []
    for p in result.problems:
        log.warning("checkpointing: retention in %s kept every data file: %s", storage.url, p)
    return doomed


def delete_step(storage: Storage, step: int) -> None:
    """Retire `step` (if committed) and remove what only it referenced."""
    collect(storage, retire=[step])


def _size(storage: Storage, path: str) -> int:
    try:
        return storage.size(path)
    except (FileNotFoundError, EOFError, OSError):
        return 0
