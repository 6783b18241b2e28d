"""TrainerCheckpoints: the CheckpointManager side of CheckpointingTrainer (layer: integrations; no transformers import).

It owns the manager (opened at the first save or load of a `train()`, closed at its end), turns
each Trainer checkpoint into one step, and keeps the `checkpoint-N` folders (_hf_markers.py) in
step with the committed steps:

- save(): writes trainer_state.json into a hidden staging folder, then `mgr.save(step, ...)`, which
  returns after the snapshot. The save's done callback (a background thread) renames the folder
  to `checkpoint-N` once the step is committed (durable on every tier; a failed upload still
  publishes it: the step is committed locally), or deletes it if the save failed; the error is
  raised at the next save() or at drain().
- Folders of ours whose step is no longer committed (retention: save_total_limit is the manager's
  SaveTotalLimit policy) are removed after each commit, at drain() and when a run starts, under one
  lock with the publishing (such a folder outlives its step by moments; resolve() checks the step).
- resolve(folder): the step a `checkpoint-N` folder names, only if it is committed.
  latest(output_dir): the newest such folder, after writing again the folders of committed steps
  that have none (the run died between a commit and the rename, or output_dir was lost) from the
  steps themselves (each holds its trainer_state.json text and contents under "trainer"); not
  folders published there and removed since (a roll-back: _hf_markers.py records publications).
- A save at a step an earlier run committed (a run resumed from an older checkpoint) replaces it,
  as the Trainer overwrites a folder: the folder goes, then the step (mgr.delete), then the save.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import shutil
import secrets
import tempfile
import threading
from typing import Any, Callable, Mapping, Sequence

import checkpointing
from checkpointing.errors import CheckpointError, CheckpointNotFoundError, CheckpointSaveError, CheckpointUploadError
from checkpointing.integrations import _hf_markers as markers
from checkpointing.integrations._saving import save_past_upload_errors, wait_past_upload_errors
from checkpointing.integrations._tier_read import load_any_tier
from checkpointing.manager import CheckpointManager, SaveHandle

log = logging.getLogger("checkpointing")

TRAINER_KEY = "trainer"  # {"state_json": <trainer_state.json text>, "contents": "model,optimizer,...", "save_id": ...} in every step


@dataclasses.dataclass(frozen=True)
class Source:
    """A committed step a `checkpoint-N` folder names."""

    folder: str
    directory: str
    step: int
    contents: frozenset[str]


@dataclasses.dataclass
class _Saving:
    step: int
    folder: str
    staging: str | None
    contents: tuple[str, ...]
    save_id: str
    settled: threading.Event = dataclasses.field(default_factory=threading.Event)


class TrainerCheckpoints:
    """Steps of a CheckpointManager in `root`, and the `checkpoint-N` folders that point at them.

    `options`: CheckpointManager's keyword options. `markers`: whether this process writes and
    removes the folders (the Trainer's `args.should_save`: process 0).
    """

    def __init__(self, root: str, options: Mapping[str, Any], *, markers: bool) -> None:
        self.root = os.path.abspath(os.path.expanduser(root))
        self._options = dict(options)
        self._markers = markers
        self._mgr: CheckpointManager | None = None
        self._readers: dict[str, CheckpointManager] = {}  # other directories a checkpoint folder named (read only)
        self._sources: dict[str, Source] = {}
        self._lock = threading.Lock()  # guards what follows and every folder operation
        self._saving: dict[int, _Saving] = {}
        self._published: dict[int, str] = {}  # step -> folder published by this object
        self._run_dirs: set[str] = set()
        self._earlier: set[int] = set()  # steps committed before this manager opened (a save there replaces them)
        self._loaded: int | None = None  # the step this run resumed from
        self._errors: dict[int | None, BaseException] = {}

    @property
    def manager(self) -> CheckpointManager | None:
        """The open CheckpointManager (None outside `train()`)."""
        return self._mgr

    def open(self) -> CheckpointManager:
        if self._mgr is None:
            self._mgr = CheckpointManager(self.root, **self._options)
            self._earlier = set(self._mgr.steps())
        return self._mgr

    # ------------------------------------------------------------------ saving

    def save(self, step: int, run_dir: str, state: dict[str, Any], *, metrics: Mapping[str, float],
             write_state_json: Callable[[str], None]) -> SaveHandle | None:
        """Snapshot `state` as `step`, its folder `run_dir/checkpoint-<step>` to follow once committed.
        None when `step` is the one this run resumed from (it holds this state already)."""
        self._raise_errors()
        mgr = self.open()
        run_dir = os.path.abspath(run_dir)
        self._start_run_dir(run_dir)
        if step == self._loaded:
            log.info("checkpointing: step %d is the step this run resumed from; not saved again", step)
            return None
        if step in self._earlier:
            self._replace(step, run_dir)
        staging = markers.stage(run_dir, step) if self._markers else None
        try:
            text = _state_json(write_state_json, staging)
            contents, save_id = (*state, TRAINER_KEY), secrets.token_hex(8)
            tree = {**state, TRAINER_KEY: {"state_json": text, "contents": ",".join(contents), "save_id": save_id}}
            handle = save_past_upload_errors(mgr, step, tree, metrics=_metrics(metrics))
        except BaseException:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
            raise
        entry = _Saving(step, os.path.join(run_dir, markers.folder_name(step)), staging, contents, save_id)
        with self._lock:
            self._saving[step] = entry
        handle.add_done_callback(functools.partial(self._settle, entry))
        return handle

    def _settle(self, entry: _Saving, handle: SaveHandle) -> None:
        """The save's done callback: publish its folder if committed, else drop it and keep the error."""
        try:
            error = handle.exception()
            committed = error is None or isinstance(error, CheckpointUploadError)  # an upload failure: committed locally
            with self._lock:
                if error is not None and not committed:  # a failed upload is logged (the manager did); training goes on
                    self._errors.setdefault(entry.step, error)
                if entry.staging is not None:
                    if committed:
                        markers.publish(entry.staging, entry.folder, markers.Pointer(self.root, entry.step, entry.contents, entry.save_id))
                        self._published[entry.step] = entry.folder
                    else:
                        shutil.rmtree(entry.staging, ignore_errors=True)
                self._saving.pop(entry.step, None)
                self._prune_locked()
        except Exception as exc:  # noqa: BLE001 - on a callback thread: keep it for the training thread
            with self._lock:
                self._errors.setdefault(entry.step, CheckpointSaveError(entry.step, f"publishing {entry.folder} failed: {exc}"))
        finally:
            entry.settled.set()

    def _start_run_dir(self, run_dir: str) -> None:
        if run_dir in self._run_dirs or not self._markers:
            return
        with self._lock:
            self._run_dirs.add(run_dir)
            markers.remove_leftovers(run_dir)
            self._prune_locked()

    def _prune_locked(self) -> None:
        """Remove our folders whose step is no longer committed (and not being saved)."""
        if not self._markers or self._mgr is None:
            return
        committed = set(self._mgr.steps())
        for run_dir in self._run_dirs:
            for _, folder in markers.scan(run_dir):
                pointer = markers.read_pointer_quietly(folder)
                if pointer is None or not _same(pointer.directory, self.root):
                    continue
                if pointer.step not in committed and pointer.step not in self._saving:
                    markers.remove(folder)
                    self._published.pop(pointer.step, None)
                    self._sources.pop(folder, None)

    def _replace(self, step: int, run_dir: str) -> None:
        log.warning("checkpointing: step %d was committed by an earlier run in %s; this save replaces it", step, self.root)
        if self._markers:
            with self._lock:
                for _, folder in markers.scan(run_dir):
                    pointer = markers.read_pointer_quietly(folder)
                    if pointer is not None and pointer.step == step and _same(pointer.directory, self.root):
                        markers.remove(folder)
                        self._sources.pop(folder, None)
        assert self._mgr is not None
        if step in self._mgr.steps():
            self._mgr.delete(step, allow_latest=True)
        self._earlier.discard(step)

    # ------------------------------------------------------------------ loading

    def resolve(self, path: str | os.PathLike[str]) -> Source:
        """The committed step the checkpoint folder `path` names; CheckpointError saying why not."""
        folder = os.path.abspath(os.fspath(path))
        if folder in self._sources:
            return self._sources[folder]
        if not os.path.isdir(folder):
            raise CheckpointNotFoundError(f"{folder}: no such checkpoint folder; pass a checkpoint-N folder of the output_dir, "
                                          "or resume_from_checkpoint=True for the newest committed one")
        pointer = markers.read_pointer(folder)
        if pointer is None:
            raise CheckpointError(f"{folder} was not written by CheckpointingTrainer (it has no {markers.POINTER_NAME}); it never "
                                  "unpickles the Trainer's own files: resume it with transformers.Trainer, or resume from a "
                                  "checkpoint-N folder CheckpointingTrainer wrote")
        mgr = self._manager_for(pointer.directory, folder)
        copied = (f" A checkpoint-N folder holds only a pointer to its run's {pointer.directory}: to move a checkpoint, copy "
                  "the output_dir with its checkpointing folder, or `checkpointing export` the step")
        if pointer.step not in mgr.steps():
            raise CheckpointNotFoundError(
                f"{folder} names step {pointer.step} of {pointer.directory}, which is not committed there (a save interrupted "
                "by a crash, a step deleted since, or a folder copied from another run): resume from another checkpoint "
                f"folder, or pass resume_from_checkpoint=True for the newest committed one.{copied}")
        if pointer.save_id is not None and _saved_by(pointer.directory, pointer.step) not in (None, pointer.save_id):
            raise CheckpointError(f"{folder} names step {pointer.step} of {pointer.directory}, but another save made that "
                                  f"step (the folder was copied from another run, or the step saved again since).{copied}")
        source = Source(folder, pointer.directory, pointer.step, frozenset(pointer.contents))
        self._sources[folder] = source
        return source

    def latest(self, output_dir: str) -> str | None:
        """The newest checkpoint folder in `output_dir` that names a committed step; None when there is none.

        Committed steps of the manager without a folder of that name (the run died between a commit
        and its rename, or output_dir was lost and the steps come from the remote tier) get theirs
        again first, written from the step itself; not a folder that was published in output_dir and
        removed since (a roll-back to an older checkpoint, as with the stock Trainer)."""
        output_dir = os.path.abspath(output_dir)
        mgr = self.open()
        chosen: str | None = None
        if self._markers:
            have = {n for n, _ in markers.scan(output_dir)}
            missing = [s for s in mgr.steps() if s not in have]
            removed = markers.published(output_dir)
            rebuilt = [step for step in missing if removed is not None and self._rebuild(output_dir, step, removed)]
            if rebuilt:
                log.warning("checkpointing: wrote the checkpoint folders of steps %s in %s again from %s (they had none)",
                            rebuilt, output_dir, self.root)
            if left := sorted(set(missing) - set(rebuilt)):
                log.warning("checkpointing: not resuming from steps %s, whose folders were removed from %s%s (their steps stay "
                            "until a save replaces them or `checkpointing rm` deletes them)", left, output_dir, "" if removed is not None
                            else f" or cannot be told from lost ones: {markers.PUBLISHED_NAME} there cannot be read (delete it to write them again)")
            chosen = self._newest_resolving(output_dir)
        if mgr.world_size == 1:
            return chosen if self._markers else self._newest_resolving(output_dir)
        # several processes: each resumes the folder process 0 chose, once it wrote the missing ones (only it writes folders)
        step = _from_process_zero(None if chosen is None else self.resolve(chosen).step, self._options.get("process_group"))
        return None if step is None else self.resolve(os.path.join(output_dir, markers.folder_name(step))).folder

    def _newest_resolving(self, output_dir: str) -> str | None:
        for _, folder in markers.scan(output_dir):
            try:
                return self.resolve(folder).folder
            except CheckpointError as exc:
                log.warning("checkpointing: not resuming from %s: %s", folder, exc)
        return None

    def _rebuild(self, output_dir: str, step: int, removed: set[tuple[int, str]]) -> bool:
        """The folder of committed `step` from the step's own record, read with load() (process 0 alone writes folders: a
        restore() is collective), from the remote tier if need be; False, nothing written, when `removed` names its save."""
        remote, options = self._options.get("remote"), self._options.get("storage_options")
        rec = load_any_tier(self.root, step, remote, options, keys=TRAINER_KEY, rank=0)[TRAINER_KEY]
        if (step, rec.get("save_id")) in removed:
            return False
        staging = markers.stage(output_dir, step)
        with open(os.path.join(staging, markers.TRAINER_STATE_NAME), "w", encoding="utf-8") as f:
            f.write(rec["state_json"])
        pointer = markers.Pointer(self.root, step, tuple(rec["contents"].split(",")), rec.get("save_id"))
        with self._lock:
            markers.publish(staging, os.path.join(output_dir, markers.folder_name(step)), pointer)
        return True

    def restore(self, source: Source, state: Mapping[str, Any]) -> None:
        """Restore the keys of `state` from `source`'s step, in place."""
        mgr = self._manager_for(source.directory, source.folder)
        mgr.restore(state, step=source.step, only=sorted(state))
        if mgr is self._mgr:
            self._loaded = source.step

    def _manager_for(self, directory: str, folder: str) -> CheckpointManager:
        if _same(directory, self.root):
            return self.open()
        if directory not in self._readers:
            if not os.path.isdir(directory):
                raise CheckpointNotFoundError(f"{folder} names the checkpoint directory {directory}, which does not exist (a "
                                              "folder copied from another run holds only a pointer to that run's directory): "
                                              "restore that directory, or resume from another checkpoint folder")
            self._readers[directory] = CheckpointManager(directory, read_only=True)
        return self._readers[directory]

    # ------------------------------------------------------------------ the end of a run

    def drain(self) -> None:
        """Wait until every save is committed and its folder published; raise the error of a failed one."""
        failure: BaseException | None = None
        if self._mgr is not None:
            failure = wait_past_upload_errors(self._mgr, "CheckpointingTrainer")  # a failed upload is logged: committed locally
            with self._lock:
                entries = list(self._saving.values())
            for entry in entries:
                entry.settled.wait()
            with self._lock:
                self._prune_locked()
        self._raise_errors(failure)

    def forget_removed(self) -> None:
        """Delete the steps whose folders (published by this object) someone else removed: the
        Trainer's own end-of-training cleanup (save_total_limit=1 with a best checkpoint), which runs
        in the processes that write folders. delete() is collective: every process calls this, and the
        steps any of them found removed go on every rank."""
        if self._mgr is None:
            return
        gone: list[int] = []
        if self._markers:
            committed = set(self._mgr.steps())
            with self._lock:
                gone = [s for s, folder in self._published.items() if not os.path.lexists(folder) and s in committed]
                for step in gone:
                    self._published.pop(step)
        if self._mgr.world_size > 1:
            import torch.distributed as dist

            found: list[list[int]] = [[] for _ in range(self._mgr.world_size)]
            dist.all_gather_object(found, gone)  # the training thread, at the end of train(): every rank is here
            gone = sorted(set().union(*found))
        for step in gone:
            self._mgr.delete(step, allow_latest=True, missing_ok=True)

    def close(self, *, raise_errors: bool = True) -> None:
        """drain(), then close the managers (the next save or load opens them again)."""
        try:
            self.drain()
        except CheckpointError as exc:
            if raise_errors:
                raise
            log.error("checkpointing: %s", exc)
        finally:
            managers = [m for m in (self._mgr, *self._readers.values()) if m is not None]
            self._mgr, self._readers = None, {}
            self._sources.clear()
            self._loaded = None
            self._earlier = set()
            self._run_dirs.clear()
            self._published.clear()
            for m in managers:
                m.close()

    def _raise_errors(self, failure: BaseException | None = None) -> None:
        with self._lock:
            errors, self._errors = self._errors, {}
        if failure is not None:
            errors.pop(getattr(failure, "step", None), None)
        found = ([failure] if failure is not None else []) + list(errors.values())
        for extra in found[1:]:
            log.error("checkpointing: %s", extra)
        if found:
            raise found[0]


def _from_process_zero(step: int | None, group: Any) -> int | None:
    """Process 0's `step`, on every process of `group` (default: the world)."""
    import torch.distributed as dist

    box = [step]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return box[0]


def _same(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def _state_json(write: Callable[[str], None], staging: str | None) -> str:
    """trainer_state.json as `write` (TrainerState.save_to_json) writes it: into `staging`, or a temporary folder."""
    if staging is not None:
        path = os.path.join(staging, markers.TRAINER_STATE_NAME)
        write(path)
        with open(path, encoding="utf-8") as f:
            return f.read()
    with tempfile.TemporaryDirectory() as tmp:
        return _state_json(write, tmp)


def _saved_by(directory: str, step: int) -> str | None:
    """The save id `step` of the manager directory records (None: not known here, such as a step on the remote tier only)."""
    try:
        return checkpointing.load(directory, step, keys=TRAINER_KEY, rank=0)[TRAINER_KEY].get("save_id")
    except (CheckpointError, KeyError, AttributeError, TypeError):
        return None


def _metrics(values: Mapping[str, float]) -> dict[str, float]:
    """The numbers save(..., metrics=) accepts (at most 64 finite values with printable names)."""
    good = {name: float(v) for name, v in values.items() if isinstance(name, str) and 1 <= len(name) <= 128 and name.isprintable()
            and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
    return dict(list(good.items())[:64])
