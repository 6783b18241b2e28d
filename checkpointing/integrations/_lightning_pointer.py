"""Pointer files of LightningCheckpointIO (layer: integrations; no Lightning import here).

A pointer file is what LightningCheckpointIO writes at each path Lightning names
(`.../epoch=0-step=100.ckpt`, `last.ckpt`): a small JSON object naming a committed step of a
CheckpointManager directory and the id of the save that made it:

    {"lightning_checkpoint_io": 1, "directory": "/abs/ckpt", "step": 100, "save_id": "9f0c...",
     "overrides": null | {"tree": <tree>, "tensors": [{"dtype": "float32", "shape": [], "data": <base64>}]},
     "keys": null | ["state_dict", "epoch", ...], "renames": null | {"state_dict": "state_dict@9f0c..."},
     "pending": null | {"step": 104, "save_id": "77ab..."}}

`overrides` holds the entries of a second save at one global step that the step itself does not
(see lightning.py; encoded by _lightning_values.encode_entries); `keys`, the checkpoint's own entries
in their order, where the step holds others too; `renames`, the step's entry holding a key's value where
that is not the key itself (_lightning_same_step.py); `pending`, on a placeholder (_lightning_pending.py), the save
whose pointer replaces it at its commit: until then it reads as the committed step it names. Absent `keys`,
`renames` or `pending` read as null.
Pointers are written atomically (a temporary file, fsync, rename, fsync of the directory) and
start with their magic key, so a scan tells them from other files by their first bytes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import threading
from typing import Any, Iterator

import checkpointing
from checkpointing.errors import CheckpointError, CheckpointMismatchError, CheckpointNotFoundError
from checkpointing.integrations._tier_read import load_any_tier
from checkpointing.storage import Storage

MAGIC = "lightning_checkpoint_io"
VERSION = 1
RELEASED_NAME = "lightning-released.json"  # in the manager directory: steps released, not yet deleted
DIRS_NAME = "lightning-dirs.json"  # in the manager directory: every folder a pointer to its steps was written in
MAX_POINTER_BYTES = 8 << 20  # a pointer with overrides is a few KiB; anything larger is not one of ours
_HEAD = ('{"%s":' % MAGIC).encode()


@dataclasses.dataclass(frozen=True)
class Pointer:
    """What a pointer file says: `step` of the manager directory `directory`, made by save `save_id`."""

    directory: str
    step: int
    save_id: str
    overrides: dict[str, Any] | None = None  # encode_entries() output, or None
    keys: tuple[str, ...] | None = None  # the entries loaded for it, in order; None: all the step's
    renames: dict[str, str] | None = None  # key -> the step's entry that holds its value (None: each key's own)
    pending: tuple[int, str] | None = None  # a placeholder: (step, save id) of the save whose pointer replaces it

    def stored(self, key: str) -> str:
        return key if self.renames is None else self.renames.get(key, key)


def new_save_id() -> str:
    return secrets.token_hex(8)


def write_pointer(path: str, pointer: Pointer) -> None:
    """Write `pointer` at `path` atomically: readers see the old file or the new one, never a part. CheckpointError
    when it cannot be written (the step it names is committed)."""
    body = {MAGIC: VERSION, "directory": pointer.directory, "step": pointer.step, "save_id": pointer.save_id,
            "overrides": pointer.overrides, "keys": None if pointer.keys is None else list(pointer.keys), "renames": pointer.renames,
            "pending": None if pointer.pending is None else {"step": pointer.pending[0], "save_id": pointer.pending[1]}}
    try:
        _write_atomic(path, json.dumps(body, allow_nan=False, separators=(",", ":")).encode())
    except OSError as exc:
        raise CheckpointError(f"cannot write the pointer file {path} for step {pointer.step} ({exc}); "
                              f"the step is committed in {pointer.directory}") from exc


def holds(directory: str, step: int, save_id: str, key: str) -> bool:
    """Whether the manager directory `directory` holds `step` as saved by save `save_id` (its `key` entry)."""
    try:
        return checkpointing.load(directory, step, keys=key).get(key, {}).get("save_id") == save_id
    except (CheckpointError, OSError, AttributeError):
        return False


def load_step(directory: str, step: int, target: str, keys: list[str] | None, codecs: Any,
              remote: tuple[str | None, Any] | None, id_key: str) -> dict[str, Any]:
    """`step` of the manager directory `directory` (its entries `keys` and `id_key`, or all), or of the
    manager's remote tier `remote` (url, storage_options) where the directory lacks it (a replaced node)."""
    url, options = remote if remote is not None else (None, None)
    try:
        try:
            return load_any_tier(directory, step, url, options, codecs=codecs, **({} if keys is None else {"keys": [*keys, id_key]}))
        except CheckpointMismatchError:  # a key the step lacks: all of it
            return load_any_tier(directory, step, url, options, codecs=codecs)
    except CheckpointNotFoundError as missing:
        raise CheckpointNotFoundError(f"{target} names step {step} of {directory}, which is not there: {missing}") from missing


def read_released(storage: Storage) -> set[int]:
    """The steps of the manager directory (its local tier `storage`) an earlier LightningCheckpointIO
    released (no pointer named them any more) and had not deleted yet when it stopped (a crash while
    a save was in flight)."""
    try:  # the tier's reads: never through a link, never a FIFO's blocking read
        body = json.loads(storage.get(RELEASED_NAME, max_bytes=MAX_POINTER_BYTES))
        steps = body["released"] if isinstance(body, dict) and body.get(MAGIC) == VERSION else []
        return {s for s in steps if isinstance(s, int) and not isinstance(s, bool) and s >= 0}
    except (OSError, CheckpointError, ValueError, KeyError, TypeError):
        return set()  # none, or not ours: nothing is deleted for it


def write_released(storage: Storage, steps: set[int]) -> None:
    """Record `steps` as released (read_released); none: the record goes. Written (and fsynced) only
    when it changes: the training thread calls this at each save while one is in flight."""
    if steps and steps == read_released(storage):
        return
    if steps:
        storage.put(RELEASED_NAME, json.dumps({MAGIC: VERSION, "released": sorted(steps)}).encode())
    else:
        storage.delete(RELEASED_NAME)


def read_dirs(storage: Storage) -> set[str]:
    """The folders earlier runs wrote pointers to this manager directory's steps in (remember_dirs): a step
    another ModelCheckpoint's pointer names stays, although this run has not touched that folder yet."""
    try:
        body = json.loads(storage.get(DIRS_NAME, max_bytes=MAX_POINTER_BYTES))
        dirs = body["dirs"] if isinstance(body, dict) and body.get(MAGIC) == VERSION else []
        return {d for d in dirs if isinstance(d, str) and os.path.isabs(d)}
    except (OSError, CheckpointError, ValueError, KeyError, TypeError):
        return set()


def remember_dirs(storage: Storage, dirs: set[str]) -> None:
    """Add `dirs` to the record read_dirs reads (written only when it grows)."""
    known = read_dirs(storage)
    if not dirs <= known:
        storage.put(DIRS_NAME, json.dumps({MAGIC: VERSION, "dirs": sorted(known | dirs)}).encode())


def _write_atomic(path: str, data: bytes) -> None:
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_pointer(path: str) -> Pointer | None:
    """The pointer at `path`; None when the file is not a pointer (another file: no magic at its start).

    A file that starts like a pointer but is not a valid one raises CheckpointError naming it.
    FileNotFoundError when there is no file.
    """
    with open(path, "rb") as f:
        head = f.read(len(_HEAD))
        if head != _HEAD:  # another file (a torch.save checkpoint, a log): not read further
            return None
        data = head + f.read(MAX_POINTER_BYTES + 1 - len(head))
    if len(data) > MAX_POINTER_BYTES:
        return None
    try:
        obj = json.loads(data.decode("utf-8"))
        if obj.get(MAGIC) != VERSION:
            raise ValueError(f"version {obj.get(MAGIC)!r}; this library reads version {VERSION}")
        directory, step, save_id, overrides, keys = obj["directory"], obj["step"], obj["save_id"], obj["overrides"], obj.get("keys")
        renames, pending = obj.get("renames"), obj.get("pending")
        if not isinstance(directory, str) or not isinstance(save_id, str) or isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError("directory, step or save_id has the wrong type")
        if overrides is not None and not (isinstance(overrides, dict) and isinstance(overrides.get("tree"), dict)
                                          and isinstance(overrides.get("tensors"), list)):
            raise ValueError("overrides must be null or {tree, tensors}")
        if keys is not None and not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)):
            raise ValueError("keys must be null or a list of strings")
        if renames is not None and not (isinstance(renames, dict) and all(isinstance(v, str) for v in renames.values())):
            raise ValueError("renames must be null or an object of strings")
        if pending is not None:
            pending = (pending["step"], pending["save_id"])
            if isinstance(pending[0], bool) or not isinstance(pending[0], int) or not isinstance(pending[1], str):
                raise ValueError("pending must be null or {step, save_id}")
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise CheckpointError(f"{path} is a damaged LightningCheckpointIO pointer file ({exc}): "
                              "delete it, or pass the path of another checkpoint") from None
    return Pointer(directory, step, save_id, overrides, None if keys is None else tuple(keys), renames, pending)


def read_pointer_quietly(path: str) -> Pointer | None:
    """read_pointer(), with None for a missing, unreadable or damaged file (scans, cleanups)."""
    try:
        return read_pointer(path)
    except (OSError, CheckpointError):
        return None


def scan(folder: str) -> Iterator[tuple[str, Pointer]]:
    """Every pointer file in `folder` (not recursive; symbolic links are followed): (path, pointer)."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        if entry.name.startswith(".") or not entry.is_file():
            continue
        pointer = read_pointer_quietly(entry.path)
        if pointer is not None:
            yield entry.path, pointer


@dataclasses.dataclass
class PointedStep:
    """A step this object saved or loaded, and the pointers to it that wait for its commit."""

    save_id: str
    handle: Any = None  # its SaveHandle; None: committed before this object saw it
    committed: bool = True
    pending: dict[str, tuple[dict | None, tuple[str, ...] | None, dict | None]] = dataclasses.field(default_factory=dict)  # path -> (overrides, keys, renames)
    settled: threading.Event = dataclasses.field(default_factory=threading.Event)  # done callback finished
    keys: tuple[str, ...] | None = None  # the entries the step holds (None: not known)
    marks: dict[str, list] | None = None  # _lightning_same_step.marks() of the save that made it (None: loaded)

    def in_flight(self) -> bool:
        return self.handle is not None and not self.settled.is_set()

    def wait_committed(self) -> bool:
        """Wait until its save ended and its pointers are written; whether it committed."""
        if self.handle is not None:
            try:
                self.handle.wait()
            except CheckpointError:
                pass  # its done callback keeps the error, raised at the next call
            self.settled.wait()
        return self.committed
