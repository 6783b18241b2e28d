"""LightningCheckpointIO: Lightning's CheckpointIO on a CheckpointManager (layer: integrations).

    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from checkpointing.integrations.lightning import LightningCheckpointIO

    trainer = Trainer(plugins=[LightningCheckpointIO("/nvme/ckpt/run1")],
                      callbacks=[ModelCheckpoint(dirpath="ckpts", save_last=True)])
    trainer.fit(model, ckpt_path="last")

`save_checkpoint` returns after the snapshot; writing and commit go on in the background. `teardown` (end
of fit/validate/test) waits until every save is durable and its pointers written, deletes what Lightning
removed, closes the manager and raises a failed save's error. Steps are numbered by `global_step`; at each
path a small JSON pointer file (_lightning_pointer.py) names the committed step; a second save at one step
is an alias where it can be (_lightning_same_step.py). The rules: docs/design.md, "The Lightning plugin".
Never pickles (the spawn launchers' weights hand-off: _lightning_transfer.py). Inference: `io.load_module`.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import logging
import os
import shutil
import threading
from typing import Any, Sequence

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

import checkpointing
from checkpointing.errors import (CheckpointConfigError, CheckpointError, CheckpointNotFoundError,
                                  CheckpointSaveError, CheckpointUploadError, StateError)
from checkpointing.integrations import _lightning_lifecycle as life
from checkpointing.integrations import _lightning_pending as pend
from checkpointing.integrations import _lightning_pointer as ptr
from checkpointing.integrations import _lightning_same_step as same
from checkpointing.integrations import _lightning_transfer as weights
from checkpointing.integrations import _lightning_values as vals
from checkpointing.integrations._lightning_module import module_from
from checkpointing.integrations._saving import save_past_upload_errors, wait_past_upload_errors
from checkpointing.manager import CheckpointManager, SaveHandle
from checkpointing.state.codecs import Codec

__all__ = ["LightningCheckpointIO"]

log = logging.getLogger("checkpointing")

ID_KEY = "_lightning_checkpoint_io"  # stored in every step: {"save_id": ...}, checked against the pointer at load


class LightningCheckpointIO(CheckpointIO):
    """A Lightning CheckpointIO that saves through a CheckpointManager in `local_dir` (see the module docstring).
    `codecs`: checkpointing.Codecs for hyper-parameter values that are not JSON-like (ours for argparse.Namespace and
    pathlib paths are added). `manager_options`: CheckpointManager's keyword options (remote=, storage_options=, ...);
    keep_local defaults to None: Lightning's ModelCheckpoint decides what is kept."""

    def __init__(self, local_dir: str | os.PathLike, *, codecs: Sequence[Codec] = (), **manager_options: Any) -> None:
        vals.check_options(local_dir, manager_options, inspect.signature(CheckpointManager.__init__))
        self.directory = os.path.abspath(os.path.expanduser(os.fspath(local_dir)))
        self._options = manager_options
        self._codecs = vals.with_codecs(codecs)
        self._mgr: CheckpointManager | None = None
        self._lock = threading.Lock()  # guards everything below and every pointer file operation
        self._steps: dict[int, ptr.PointedStep] = {}
        self._on_disk: set[int] = set()  # committed steps of the directory (listed once per manager)
        self._doomed: set[int] = set()  # steps that lost a pointer: deleted once nothing refers to them
        self._dirs: set[str] = set()  # directories of the pointers this object wrote or read
        self._errors: list[BaseException] = []  # failed saves seen by done callbacks, raised at the next call
        self._reported: set[int] = set()  # failed steps the manager raised itself already
        self._removals = pend.Removals(self.directory)  # what Lightning removed while a save was in flight (_lightning_pending.py)
        self._user_codecs = tuple(codecs)
        self._opener = life.arm(self)  # opens the manager at a Trainer's first step (_lightning_lifecycle.py)

    def __reduce__(self) -> tuple:  # Lightning's spawn launcher sends the plugin to its workers: a new one with this configuration
        if self._mgr is not None:
            raise CheckpointConfigError("a LightningCheckpointIO that has saved cannot be sent to another process: create it there")
        return functools.partial(type(self), codecs=self._user_codecs, **self._options), (self.directory,)

    @property
    def manager(self) -> CheckpointManager | None:
        """The open CheckpointManager (None before the first save and after teardown)."""
        return self._mgr

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Snapshot `checkpoint` as step checkpoint["global_step"] (an alias where this object saved it); returns after the snapshot."""
        if storage_options is not None:
            raise CheckpointConfigError("LightningCheckpointIO.save_checkpoint takes no storage_options: pass the manager's "
                                        "options to LightningCheckpointIO(dir, ...) instead")
        self._raise_errors()
        target = vals.local_path(path)
        if weights.is_weights(checkpoint):  # the spawn/fork launchers' hand-off to the main process (_lightning_transfer.py)
            return weights.save(checkpoint, target)
        step = checkpoint.get("global_step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointConfigError(f"the checkpoint for {target} has global_step={step!r}: LightningCheckpointIO numbers steps by it")
        if ID_KEY in checkpoint:
            raise CheckpointConfigError(f"the checkpoint for {target} has a key {ID_KEY!r}, which LightningCheckpointIO reserves")
        with self._lock:
            if not self._removals.arrives(target):  # removed by Lightning while its save waited in a wrapper's queue
                return
        os.makedirs(os.path.dirname(target), exist_ok=True)  # as Torch's IO: Lightning may link to the path at once
        mgr = self._open()
        self._collect()
        with self._lock:
            self._dirs.add(os.path.dirname(target))
            known = self._steps.get(step)
        plan = self._at_saved_step(checkpoint, target, step, known) if known is not None else ({}, {})
        if plan is None:
            return
        held, repoint = plan
        if step in self._on_disk:
            self._replace(step)
        content = {**checkpoint, **held}
        entry = ptr.PointedStep(ptr.new_save_id(), committed=False, keys=tuple(content), marks=same.marks(content))
        try:
            entry.handle = save_past_upload_errors(mgr, step, {**content, ID_KEY: {"save_id": entry.save_id}})
        except StateError as exc:
            raise StateError(f"{exc}{vals.namespaces_hint(exc, checkpoint)}. {vals.CODEC_HINT}") from exc
        except CheckpointSaveError as exc:  # an earlier save failed: the manager reports it here
            with self._lock:
                self._reported.add(exc.step)
            raise
        with self._lock:
            self._steps[step] = entry
            self._on_disk.add(step)
            entry.pending.update(repoint)
        self._add_alias(target, step, entry, None, tuple(checkpoint) if held else None)
        entry.handle.add_done_callback(functools.partial(self._settle, step, entry))

    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint dict saved for `path`: CPU tensors unless `map_location` moves them (weights_only: nothing is unpickled anyway)."""
        target = vals.local_path(path)
        pend.wait_for_save(target, self._steps, self._lock)  # a save for `target` in flight: its pointer first
        if not os.path.exists(target):
            raise CheckpointNotFoundError(f"Checkpoint file not found: {target}")
        pointer = ptr.read_pointer(target)
        if pointer is None and (handed := weights.load(target, map_location)) is not None:
            return handed
        if pointer is None:
            raise CheckpointError(f"{target} is not a LightningCheckpointIO pointer file (a torch.save checkpoint?): "
                                  "LightningCheckpointIO never unpickles; load it with Lightning's TorchCheckpointIO, or "
                                  "import it first: checkpointing import SRC DEST")
        # ours when it holds that save (the run was copied or moved; the save id tells), else the one the pointer names
        ours_too = pointer.directory != self.directory and ptr.holds(self.directory, pointer.step, pointer.save_id, ID_KEY)
        directory = self.directory if ours_too or not os.path.isdir(pointer.directory) else pointer.directory
        ours = directory == self.directory
        with self._lock:
            entry = self._steps.get(pointer.step) if ours else None
        if entry is not None and entry.in_flight():  # a save of this step in flight here: load once it rewrote the pointers
            entry.wait_committed()
            pointer = ptr.read_pointer(target) or pointer
        with self._lock:
            waiting = self._steps.get(pointer.pending[0]) if pointer.pending is not None and ours else None
        pointer = pend.past_placeholder(target, pointer, waiting)  # a placeholder (_lightning_pending.py)
        extra = {} if pointer.overrides is None else vals.decode_entries(pointer.overrides, self._codecs, target)
        stored = None if pointer.keys is None else [pointer.stored(k) for k in pointer.keys if k not in extra]
        tree = self._load_step(directory, pointer.step, target, stored)
        saved = tree.pop(ID_KEY, None)
        if not isinstance(saved, dict) or saved.get("save_id") != pointer.save_id:
            raise CheckpointError(f"{target} names step {pointer.step} of {directory} as saved by save {pointer.save_id}, "
                                  "but that step was replaced by another save since (a run resumed from an older checkpoint "
                                  "saved it again): load another checkpoint, or delete this pointer file")
        keys = tuple(tree) if pointer.keys is None else None  # the step's entries, when all were read
        tree.update(extra)
        if pointer.keys is not None:
            tree = {k: extra[k] if k in extra else tree[pointer.stored(k)] for k in pointer.keys if k in extra or pointer.stored(k) in tree}
        with self._lock:
            self._dirs.add(os.path.dirname(target))
            if ours:
                self._steps.setdefault(pointer.step, ptr.PointedStep(pointer.save_id, keys=keys))
        return vals.placed(tree, map_location)

    def load_module(self, cls: type, path: Any, **kwargs: Any) -> Any:
        """`cls.load_from_checkpoint(path, **kwargs)` for a path this plugin saved to (Lightning's own torch.loads the pointer)."""
        return module_from(cls, self.load_checkpoint(path), **kwargs)

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the pointer at `path`; its step goes once nothing refers to it (see the module docstring)."""
        target = vals.local_path(path)
        if self._mgr is None and getattr(ptr.read_pointer_quietly(target), "directory", None) == self.directory:
            self._open()  # a plugin that has not saved (a cleanup script): deleting the step needs the manager
        with self._lock:  # while the newest save is in flight, at its commit: the old pointer stays until the new one is there
            self._removals.request(target, self._remove_now, self._steps)
            saves_elsewhere = self._removals.reordered  # on a wrapper's thread, which collects at its next save call
        if not saves_elsewhere:
            self._collect()

    def _remove_now(self, target: str) -> None:
        """Remove the pointer (or the alias waiting) at `target` (the lock held); its step may go."""
        for step, entry in self._steps.items():
            if target in entry.pending:
                del entry.pending[target]
                self._doomed.add(step)
        pointer = ptr.read_pointer_quietly(target)
        if pointer is not None and pointer.directory == self.directory:  # (a placeholder: its save's step too, left by a crash)
            self._doomed.update([pointer.step] + ([pointer.pending[0]] if pointer.pending is not None else []))
            self._journal()
        if os.path.isdir(target) and not os.path.islink(target):
            shutil.rmtree(target)
        elif os.path.lexists(target):
            os.remove(target)

    def teardown(self) -> None:
        """Wait until every save is durable and its pointers written, delete what was removed, close; raise a save's error."""
        mgr, failure = self._mgr, None
        if mgr is not None:
            atexit.unregister(self._at_exit)
            try:
                failure = wait_past_upload_errors(mgr, "LightningCheckpointIO")  # a failed upload is logged: its step is committed
                with self._lock:
                    if failure is not None:
                        self._reported.add(failure.step)
                    entries = list(self._steps.values())
                for entry in entries:
                    if entry.handle is not None:
                        entry.settled.wait()  # its done callback wrote its pointers
                self._removals.left()  # (every save settled) the removals no committed save took: those pointers stay (logged)
                self._collect()
            finally:
                self._mgr = None
                mgr.close()
        self._raise_errors(failure)

    def _open(self) -> CheckpointManager:
        if self._mgr is None:
            vals.check_one_writer(self._options)
            self._mgr = CheckpointManager(self.directory, codecs=self._codecs, **self._options)
            atexit.register(self._at_exit)  # runs before the manager's own close at exit
            self._on_disk = set(self._mgr.steps())
            self._doomed |= ptr.read_released(self._mgr.storage) & self._on_disk  # an earlier run's, which stopped before deleting them
            self._dirs |= ptr.read_dirs(self._mgr.storage)  # the folders earlier runs' pointers are in: their steps stay
        return self._mgr

    def _at_exit(self) -> None:  # a save_checkpoint as a script's last line: its pointers are written before the interpreter exits
        try:
            self.teardown()
        except Exception as exc:  # noqa: BLE001 - exiting: report, do not raise
            log.error("checkpointing: LightningCheckpointIO at exit: %s", exc)

    def _journal(self) -> None:  # record the doomed steps (the lock held) before a pointer moves off one: a crash leaves them to the next run
        if self._mgr is not None:
            ptr.write_released(self._mgr.storage, self._doomed & self._on_disk)

    def _add_alias(self, target: str, step: int, entry: ptr.PointedStep, overrides: dict | None, keys: tuple | None,
                   renames: dict | None = None) -> None:
        """`target` names `step` from now on: its pointer now if committed, else once it is (a placeholder meanwhile: pending.place)."""
        with self._lock:
            for other, e in self._steps.items():
                if e is not entry and target in e.pending:  # `target` named another step not committed yet
                    del e.pending[target]
                    self._doomed.add(other)
            if entry.committed:
                self._write(target, step, entry, overrides, keys, renames)
            else:
                entry.pending[target] = (overrides, keys, renames)
                committed = {s for s in self._on_disk if not (s in self._steps and self._steps[s].in_flight())}
                pend.place(target, self.directory, committed, (step, entry.save_id))
            self._removals.saved(target, entry, self._remove_now)

    def _settle(self, step: int, entry: ptr.PointedStep, handle: SaveHandle) -> None:
        """The done callback of a save (a background thread): write its pointers, or keep its error."""
        try:
            error = handle.exception()
            with self._lock:
                if error is not None and step not in self._reported and not isinstance(error, CheckpointUploadError):  # logged
                    self._errors.append(error)
                if error is None or isinstance(error, CheckpointUploadError):  # committed (an upload error leaves it local)
                    entry.committed = True
                    pending, entry.pending = entry.pending, {}
                    for target, view in pending.items():
                        self._write(target, step, entry, *view)
                else:
                    pending = entry.pending = {}
                    self._on_disk.discard(step)
                    if self._steps.get(step) is entry:
                        del self._steps[step]
                self._removals.settled(entry, self._remove_now, pending, self._steps)  # after its pointers: the old ones go now
        except Exception as exc:  # noqa: BLE001 - raised at the next call instead of dying on this thread
            with self._lock:
                self._errors.append(exc)
        finally:
            entry.settled.set()

    def _write(self, target: str, step: int, entry: ptr.PointedStep, overrides: dict | None, keys: tuple | None,
               renames: dict | None = None) -> None:
        """Write a pointer (the lock held); the step it replaces at `target` may go."""
        old = ptr.read_pointer_quietly(target)
        if old is not None and old.directory == self.directory and old.step != step:
            self._doomed.add(old.step)
            self._journal()
        ptr.write_pointer(target, ptr.Pointer(self.directory, step, entry.save_id, overrides, keys, renames))
        self._dirs.add(os.path.dirname(target))
        if self._mgr is not None:
            ptr.remember_dirs(self._mgr.storage, self._dirs)

    def _referenced(self) -> set[int]:
        """Steps a pointer (in the directories this object knows) or an alias waiting names (the lock held)."""
        steps = {s for s, e in self._steps.items() if e.pending}
        for folder in self._dirs:
            for _, p in ptr.scan(folder):
                known = self._steps.get(p.step)
                if p.directory == self.directory and (known is None or known.save_id == p.save_id):  # not a stale pointer
                    steps.add(p.step)
        return steps

    def _collect(self) -> None:
        """Delete the doomed steps nothing refers to, when no save is in flight (on the thread that calls save_checkpoint:
        a wrapper's own, whose save calls may alias a step); while one is, record them in the directory
        (ptr.write_released): a crash leaves them to the next run's first call."""
        mgr = self._mgr
        with self._lock:
            if mgr is None or not self._doomed:
                return
            if any(e.in_flight() for e in self._steps.values()):
                ptr.write_released(mgr.storage, {s for s in self._doomed - self._referenced() if s in self._on_disk
                                                    and not (s in self._steps and self._steps[s].in_flight())})
                return
            doomed, self._doomed = self._doomed - self._referenced(), set()
        kept = life.delete_steps(mgr, sorted(s for s in doomed if s in self._on_disk))
        with self._lock:
            for step in doomed - kept:
                self._on_disk.discard(step)
                self._steps.pop(step, None)
            self._doomed |= kept
        ptr.write_released(mgr.storage, kept)

    def _replace(self, step: int) -> None:
        """A save at `step`, committed by an earlier run: delete the old step and the pointers naming it."""
        assert self._mgr is not None
        log.warning("checkpointing: step %d in %s was saved by an earlier run; Lightning saves it again (a resume from an "
                    "older checkpoint): the old step and its pointer files are replaced", step, self.directory)
        self._mgr.delete(step, allow_latest=True)
        with self._lock:
            for path in [path for folder in self._dirs for path, p in ptr.scan(folder) if (p.directory, p.step) == (self.directory, step)]:
                os.remove(path)
            self._on_disk.discard(step)
            self._doomed.discard(step)

    def _load_step(self, directory: str, step: int, target: str, keys: list[str] | None = None) -> dict[str, Any]:
        remote = (self._options.get("remote"), self._options.get("storage_options")) if directory == self.directory else None
        return ptr.load_step(directory, step, target, same.literal(keys) if keys else None, self._codecs, remote, ID_KEY)

    def _at_saved_step(self, checkpoint: dict[str, Any], target: str, step: int, known: ptr.PointedStep) -> tuple[dict, dict] | None:
        """A save at a step this object saved or loaded (_lightning_same_step.py): None once it is an alias, else _resave()'s."""
        carried = set(vals.carried(checkpoint))
        rest = [k for k in checkpoint if k not in carried]  # what an alias takes from the step
        missing = [k for k in rest if known.keys is not None and k not in known.keys]
        changed = set() if known.marks is None else same.differing(known.marks, checkpoint, [k for k in rest if k not in missing])
        if (changed or missing) and not known.wait_committed():
            return {}, {}  # its save failed (reported at the next call): a save like any other
        if changed:  # a fresh copy per save, or other values: the bytes tell
            saved = self._load_step(self.directory, step, target, sorted(changed))
            changed = {k for k in changed if k not in saved or not same.equal(checkpoint[k], saved[k])}
        if not changed and not missing:
            self._add_alias(target, step, known, vals.overrides(checkpoint, target, self._codecs), tuple(checkpoint))
            return None
        with self._lock:
            self._steps.pop(step, None)
        return self._resave(step, known, checkpoint, [k for k in rest if k not in changed])

    def _resave(self, step: int, known: ptr.PointedStep, checkpoint: dict[str, Any], same_values: list[str]) -> tuple[dict, dict]:
        """Delete the committed step `known`, to be saved again with `checkpoint` and what its pointers read that `checkpoint` has
        not alike (`same_values`: its large entries equal to the step's); returns (those entries, {path: new pointer view})."""
        pointers = [(path, p) for folder in sorted(self._dirs) for path, p in ptr.scan(folder)
                    if (p.directory, p.step, p.save_id) == (self.directory, step, known.save_id)]
        views = {path: same.view_of(p, known.keys or (), vals.decode_entries(p.overrides, self._codecs, path) if p.overrides else {})
                 for path, p in pointers}
        wanted = sorted({stored for _, reads, _ in views.values() for stored in reads.values()} - set(same_values))
        old = self._load_step(self.directory, step, str(step), wanted) if wanted else {}
        old.pop(ID_KEY, None)
        small = set(vals.carried(old))
        moved = {name: (name if name not in checkpoint else f"{name}@{known.save_id}") for name in old if name not in small}
        held = {moved[name]: old[name] for name in moved}
        repoint = {path: vals.repointed(*view, old, moved, self._codecs) for path, view in views.items()}
        assert self._mgr is not None
        self._mgr.delete(step, allow_latest=True)
        with self._lock:
            self._on_disk.discard(step)
            self._doomed.discard(step)
        return held, repoint

    def _raise_errors(self, failure: BaseException | None = None) -> None:
        with self._lock:
            errors, self._errors = self._errors, []
            self._reported.clear()
        for extra in (errors := ([failure] if failure is not None else []) + errors)[1:]:
            log.error("checkpointing: LightningCheckpointIO: %s", extra)
        if errors:
            raise errors[0]
