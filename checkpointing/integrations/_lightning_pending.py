"""What LightningCheckpointIO keeps in place while a save is in flight (layer: integrations; no Lightning import here).

A save's pointers appear at its commit (lightning.py), but Lightning acts on a path as soon as
save_checkpoint() returns: ModelCheckpoint removes the previous top-k file, and with
save_last="link" it replaces last.ckpt by a link to the new file. So that a crash at any moment
leaves the previous checkpoint reachable (docs/design.md, "The Lightning plugin"):

- a removal Lightning asks for while a save is in flight waits for that save's commit (`Removals`);
  a save that fails passes its removals on to the next save, and teardown leaves what no save took;
- a new path in a folder where Lightning links (a symbolic link to a pointer of ours is there) gets a
  placeholder at once (`place`): a copy of the newest committed pointer a link names, marked
  with the save in flight (Pointer.pending). A link made to it reads that step until the commit
  replaces the placeholder by the save's own pointer; after a crash, `ckpt_path="last"` resumes there.
- a load of a path whose save is in flight waits for that save's commit (`wait_for_save`): the path
  names the step Lightning just gave for it, never the one it named before (or nothing).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import Callable, Collection, Mapping

from checkpointing.errors import CheckpointError
from checkpointing.integrations import _lightning_pointer as ptr

log = logging.getLogger("checkpointing")


def wait_for_save(target: str, steps: Mapping[int, ptr.PointedStep], lock: threading.Lock) -> None:
    """Before `target` is loaded: wait until each save in flight whose pointer goes to `target` has written it (at its
    commit); raise when such a save failed (nothing new was written there)."""
    with lock:
        saving = [(step, entry) for step, entry in steps.items() if target in entry.pending]
    for step, entry in saving:
        if not entry.wait_committed():
            error = entry.handle.exception() if entry.handle is not None else None
            raise CheckpointError(f"{target} cannot be loaded: its save (step {step}) failed ({error}), so it names no "
                                  "checkpoint of that save: load another checkpoint, or save again") from error


def place(target: str, directory: str, committed: Collection[int], pending: tuple[int, str]) -> None:
    """Write the placeholder for a new path `target` while save `pending` (step, save id) is in flight: a copy of the
    newest pointer to a `committed` step of `directory` that a link in its folder names; nothing when `target` exists
    or no link names one (the lock of the caller held: its done callback writes the save's own pointer)."""
    folder = os.path.dirname(target)
    try:
        links = [] if os.path.lexists(target) else [e.path for e in os.scandir(folder) if e.is_symlink() and not e.name.startswith(".")]
    except OSError:
        return
    named = [p for p in map(ptr.read_pointer_quietly, links) if p is not None and p.directory == directory and p.step in committed]
    if named:
        ptr.write_pointer(target, dataclasses.replace(max(named, key=lambda p: p.step), pending=pending))


def stale(folders: Collection[str], directory: str, live: Collection[tuple[int, str]]) -> list[str]:
    """The placeholders in `folders` whose save (step, save id) is not `live` (in flight): a stopped process or a
    failed save left them. Once a later save committed in its folder, such a placeholder goes (its step may go too)."""
    found = []
    for folder in folders:
        found += [path for path, p in ptr.scan(folder) if p.pending is not None and p.pending not in live
                  and p.directory == directory and not os.path.islink(path)]
    return found


class Removals:
    """Paths Lightning removed while a save was in flight, each waiting for a save's commit (the caller's lock held
    for every call). `owner`: the entry of the newest save call (ptr.PointedStep), whose commit makes them safe."""

    def __init__(self, directory: str) -> None:
        self.directory = directory  # the manager directory the pointers name
        self.owner: ptr.PointedStep | None = None
        self.waiting: list[tuple[str, ptr.PointedStep]] = []  # (path, the save whose commit it waits for)
        self.orphans: list[str] = []  # removals whose save failed: the next save takes them
        self.reordered = False  # a wrapper (AsyncCheckpointIO) hands saves over after Lightning made them: `early`
        self.early: set[str] = set()  # paths removed before their save reached this plugin (or while it ran)
        self.arriving: set[str] = set()  # paths whose save call runs, before it is registered (`saved`)

    def request(self, target: str, remove: Callable[[str], None], steps: Mapping[int, ptr.PointedStep]) -> None:
        """Lightning removes `target`: now when the newest save is committed (or there was none), else at its commit.
        Behind a reordering wrapper, a path neither on disk nor waiting for a commit: its save is still in the wrapper's
        queue (Lightning removes only paths it saved), and is dropped when it arrives (`arrives`), or it runs now, and
        the path goes at its commit (`saved`)."""
        unknown = not os.path.lexists(target) and not any(target in e.pending for e in steps.values())
        if self.reordered and (unknown or target in self.arriving):
            self.early.add(target)
            return
        owner = self.owner
        if owner is None or (owner.committed and not owner.in_flight()):
            remove(target)
        elif owner.in_flight():
            self.waiting.append((target, owner))
        else:  # the newest save failed: the next one takes it
            self.orphans.append(target)

    def arrives(self, target: str) -> bool:
        """A save call for `target` begins: False when Lightning removed `target` already (`request`): it is not made."""
        if target in self.early:
            self.early.discard(target)
            log.debug("checkpointing: LightningCheckpointIO: %s was removed before its save reached the plugin: not saved", target)
            return False
        if self.reordered:  # the call runs beside the training thread's removals (on the wrapper's thread)
            self.arriving.add(target)
        return True

    def saved(self, target: str, entry: ptr.PointedStep, remove: Callable[[str], None]) -> None:
        """A save call for `target` made `entry` the newest: a removal of `target` waiting is void; orphans join it."""
        self.waiting = [(t, e) for t, e in self.waiting if t != target]
        self.owner = entry
        self.arriving.discard(target)
        if target in self.early:  # removed while this save call ran (a reordering wrapper): at its commit
            self.early.discard(target)
            self.waiting.append((target, entry))
        orphans, self.orphans = [t for t in self.orphans if t != target], []
        for t in orphans:
            self.request(t, remove)

    def settled(self, entry: ptr.PointedStep, remove: Callable[[str], None], written: Collection[str],
                steps: Mapping[int, ptr.PointedStep]) -> None:
        """`entry`'s save ended, its pointers at `written` if it committed: its removals go (with the placeholders a stopped
        process left in those folders: stale), or wait for the next save. `steps`: the caller's entries by step."""
        mine = [t for t, e in self.waiting if e is entry]
        self.waiting = [(t, e) for t, e in self.waiting if e is not entry]
        if entry.committed:
            live = {(s, e.save_id) for s, e in steps.items() if e.in_flight() and e is not entry}
            for t in mine + stale({os.path.dirname(t) for t in written}, self.directory, live):
                remove(t)
        elif self.owner is not None and self.owner is not entry:
            for t in mine:
                self.request(t, remove)
        else:
            self.orphans.extend(mine)

    def left(self) -> list[str]:
        """At teardown: the removals no committed save took (their pointers stay: logged); forgotten here."""
        left, self.orphans, self.owner = self.orphans + [t for t, _ in self.waiting], [], None
        self.waiting, self.early, self.arriving = [], set(), set()
        if left:
            log.warning("checkpointing: LightningCheckpointIO: %s stay, although Lightning removed them: no save "
                        "after their removal committed", ", ".join(sorted(left)))
        return left


def past_placeholder(target: str, pointer: ptr.Pointer, entry: ptr.PointedStep | None) -> ptr.Pointer:
    """The pointer to load for `target`. A placeholder whose save is in flight here (`entry`, the entry this object holds
    for its step) waits for that commit and reads the pointer that replaced it; one whose save did not complete (the
    process stopped before its commit) reads as the committed step it names, said in a warning."""
    if pointer.pending is None:
        return pointer
    if entry is not None and entry.save_id == pointer.pending[1]:
        entry.wait_committed()
        again = ptr.read_pointer_quietly(target)
        if again is not None and again.pending is None:
            return again
    log.warning("checkpointing: %s: the save of step %d for it did not complete (its process stopped before the commit, "
                "or it failed); it reads as step %d, the checkpoint a link in its folder named when that save began",
                target, pointer.pending[0], pointer.step)
    return pointer
