"""The `checkpoint-N` folders of CheckpointingTrainer (layer: integrations; no transformers import here).

The Hugging Face Trainer finds checkpoints by folder name: `train(resume_from_checkpoint=True)`
takes the `output_dir/checkpoint-N` folder with the largest N and reads its `trainer_state.json`
before any hook of ours runs. CheckpointingTrainer keeps the data in a CheckpointManager, and writes
in each such folder only two small files:

    checkpoint-N/trainer_state.json   the Trainer's own file (TrainerState.save_to_json, at save time)
    checkpoint-N/checkpointing.json   {"transformers_checkpointing": 1, "directory": "../checkpointing",
                                       "step": N, "contents": ["model", "optimizer", ...],
                                       "save_id": "9f0c..."}  (the save that made the step; absent in older folders)

`directory` is relative to the folder's parent when the CheckpointManager directory lies inside it
(moving the whole output_dir keeps the pointers valid), else absolute.

A folder is prepared under a hidden name (`.staging-checkpoint-N-<hex>`, which neither
`get_last_checkpoint` nor `sort_checkpoints` matches) and renamed to `checkpoint-N` only once its
step is committed (`publish`: files fsynced, then the rename, then the parent fsynced). A folder is
removed by renaming it to `.removing-...` first, so a crash never leaves a half-deleted
`checkpoint-N`. Leftovers of both kinds are removed when a run starts (`remove_leftovers`).

`output_dir/.checkpointing-published.json` records the folders published there, as
{"transformers_checkpointing": 1, "published": [[N, save_id], ...]} (`record_published`): a
committed step whose folder is missing is written again on resume unless its folder was
published in that output_dir and someone removed it since (a roll-back, as with the stock Trainer).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import secrets
import shutil
import stat

from checkpointing.errors import CheckpointError

POINTER_NAME = "checkpointing.json"
TRAINER_STATE_NAME = "trainer_state.json"  # transformers.trainer.TRAINER_STATE_NAME (checked in transformers.py)
PREFIX = "checkpoint"  # transformers.trainer_utils.PREFIX_CHECKPOINT_DIR
MAGIC = "transformers_checkpointing"
VERSION = 1
MAX_POINTER_BYTES = 1 << 16
_FOLDER = re.compile(rf"^{PREFIX}-(\d+)$")  # what get_last_checkpoint matches
_STAGING, _REMOVING = ".staging-", ".removing-"
PUBLISHED_NAME = ".checkpointing-published.json"
MAX_PUBLISHED = 4096  # entries kept in the record (the oldest go first)
_MAX_RECORD_BYTES = 1 << 20  # what MAX_PUBLISHED entries take, with room to spare

log = logging.getLogger("checkpointing")


@dataclasses.dataclass(frozen=True)
class Pointer:
    """What `checkpoint-N/checkpointing.json` says: step `step` of the CheckpointManager directory
    `directory` (absolute) holds this checkpoint; `contents` are the step's top-level keys."""

    directory: str
    step: int
    contents: tuple[str, ...]
    save_id: str | None = None  # the step's own record holds it too: a folder copied to another run is told apart


def folder_name(step: int) -> str:
    return f"{PREFIX}-{step}"


def stage(run_dir: str, step: int) -> str:
    """A new hidden folder in `run_dir` for checkpoint-`step`'s files (publish() renames it)."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, f"{_STAGING}{folder_name(step)}-{secrets.token_hex(4)}")
    os.mkdir(path)
    return path


def publish(staging: str, folder: str, pointer: Pointer) -> None:
    """Write `pointer` into `staging`, make its files durable, rename it to `folder` (replacing one there), record it."""
    parent = os.path.dirname(folder)
    directory = pointer.directory
    if os.path.commonpath([directory, os.path.abspath(parent)]) == os.path.abspath(parent):
        directory = os.path.relpath(directory, parent)
    body = {MAGIC: VERSION, "directory": directory, "step": pointer.step, "contents": list(pointer.contents)}
    if pointer.save_id is not None:
        body["save_id"] = pointer.save_id
    with open(os.path.join(staging, POINTER_NAME), "w", encoding="utf-8") as f:
        f.write(json.dumps(body, sort_keys=True) + "\n")
    for name in os.listdir(staging):
        _fsync(os.path.join(staging, name), os.O_RDONLY)
    _fsync(staging, os.O_RDONLY)
    if os.path.lexists(folder):
        remove(folder)
    os.rename(staging, folder)
    _fsync(parent, os.O_RDONLY)
    record_published(parent, pointer.step, pointer.save_id)


def published(run_dir: str) -> set[tuple[int, str]] | None:
    """The (step, save_id) of the folders published in `run_dir`: empty without a record, None when the record
    cannot be read (not a regular file, damaged, or larger than this library writes)."""
    path = os.path.join(run_dir, PUBLISHED_NAME)
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return None
        with open(path, "rb") as f:
            data = f.read(_MAX_RECORD_BYTES + 1)
    except FileNotFoundError:
        return set()
    except OSError:
        return None
    try:
        obj = json.loads(data.decode("utf-8")) if len(data) <= _MAX_RECORD_BYTES else None
        entries = obj["published"] if isinstance(obj, dict) and obj.get(MAGIC) == VERSION else None
        return {(e[0], e[1]) for e in entries if isinstance(e, list) and len(e) == 2
                and isinstance(e[0], int) and not isinstance(e[0], bool) and isinstance(e[1], str)}
    except (UnicodeDecodeError, ValueError, KeyError, TypeError):
        return None


def record_published(run_dir: str, step: int, save_id: str | None) -> None:
    """Add checkpoint-`step` (the save `save_id`) to `run_dir`'s record of published folders (best effort: a
    record that cannot be written is logged; resuming then writes a removed folder again, as before records)."""
    if save_id is None:
        return
    entries = sorted((published(run_dir) or set()) | {(step, save_id)})[-MAX_PUBLISHED:]
    path = os.path.join(run_dir, PUBLISHED_NAME)
    tmp = f"{path}.tmp-{secrets.token_hex(6)}"
    try:
        with open(tmp, "x", encoding="utf-8") as f:
            f.write(json.dumps({MAGIC: VERSION, "published": [list(e) for e in entries]}) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("checkpointing: cannot record checkpoint-%d in %s (%s): remove what is there, so that removing a "
                    "checkpoint folder is a roll-back again", step, path, exc)
        with contextlib.suppress(OSError):
            os.remove(tmp)


def read_pointer(folder: str) -> Pointer | None:
    """The pointer in `folder`; None when it has none (not a CheckpointingTrainer folder).
    CheckpointError naming the file when it is damaged."""
    path = os.path.join(folder, POINTER_NAME)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_POINTER_BYTES + 1)
    except FileNotFoundError:
        return None
    try:
        obj = json.loads(data.decode("utf-8"))
        if not isinstance(obj, dict) or obj.get(MAGIC) != VERSION:
            raise ValueError(f"not version {VERSION} of a {MAGIC} pointer")
        directory, step, contents = obj["directory"], obj["step"], obj["contents"]
        if not isinstance(directory, str) or not directory or isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError("directory or step has the wrong type")
        if not isinstance(contents, list) or not all(isinstance(c, str) for c in contents):
            raise ValueError("contents must be a list of strings")
        save_id = obj.get("save_id")
        if save_id is not None and not isinstance(save_id, str):
            raise ValueError("save_id must be a string")
    except (UnicodeDecodeError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{path} is damaged ({exc}): delete the folder {folder}, or resume from another checkpoint") from None
    return Pointer(os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(folder)), directory)), step, tuple(contents), save_id)


def read_pointer_quietly(folder: str) -> Pointer | None:
    """read_pointer(), with None for a missing, unreadable or damaged pointer (scans, cleanups)."""
    try:
        return read_pointer(folder)
    except (OSError, CheckpointError):
        return None


def scan(run_dir: str) -> list[tuple[int, str]]:
    """The `checkpoint-N` folders in `run_dir` as (N, path), newest first (any kind, ours or not)."""
    try:
        names = os.listdir(run_dir)
    except OSError:
        return []
    found = [(int(m.group(1)), os.path.join(run_dir, n)) for n in names if (m := _FOLDER.match(n))]
    return sorted((f for f in found if os.path.isdir(f[1])), reverse=True)


def remove(folder: str) -> None:
    """Remove `folder`: renamed out of sight first, then deleted."""
    parent, name = os.path.split(folder)
    doomed = os.path.join(parent, f"{_REMOVING}{name}-{secrets.token_hex(4)}")
    os.rename(folder, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def remove_leftovers(run_dir: str) -> None:
    """Remove the staging and removal folders an interrupted run left in `run_dir`."""
    try:
        names = os.listdir(run_dir)
    except OSError:
        return
    for name in names:
        if name.startswith((_STAGING + PREFIX, _REMOVING + PREFIX)):
            shutil.rmtree(os.path.join(run_dir, name), ignore_errors=True)


def _fsync(path: str, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
