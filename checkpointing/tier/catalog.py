"""The steps on one tier: list them, read a committed step's manifest, commit (I/O).

A step is committed only when its COMMIT marker exists and names a manifest whose sha256 matches.
The COMMIT also carries the step's metrics (save(..., metrics=...)), copied from its manifest, so
that retention reads them without reading any manifest (`step_infos`).
Write order: pack data -> manifest -> COMMIT. Deleting (retention, gc) is collect.py's: COMMIT first,
then whatever no committed step or save in flight references.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from typing import Iterable, Iterator

from checkpointing.format import naming
from checkpointing.errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError, CommitConflictError, ManifestError
from checkpointing.format.decode import decode_commit, decode_manifest
from checkpointing.format.manifest import CommitMarker, Manifest, encode_commit, encode_manifest, manifest_digest
from checkpointing.plan.retention import StepInfo
from checkpointing.storage import Storage
from checkpointing.storage.local import SymlinkSkipped
from checkpointing.tier.tierfile import read_tier_id

log = logging.getLogger("checkpointing")

MAX_COMMIT_BYTES = 64 << 10  # a COMMIT marker is a few hundred bytes; anything larger is not one
MAX_MANIFEST_BYTES = 1 << 30  # far above any real manifest (a 4,000-shard one is a few MB)
# manifests kept decoded, by digest: the newest step's (the next save's base refers to most of it anyway)
# and the one before (keep_local=2's retention reads both after each save); ~370 B a chunk decoded
DECODED_KEPT = 2


class _Decoded:
    """The last few manifests decoded, by the sha256 of their bytes (which the COMMIT names and the
    reader checks before decoding): the same bytes decode to the same frozen Manifest, so a step's
    manifest is decoded once, not on every save that re-reads it (retention) or on a restore that
    reads it twice. Thread-safe; a manifest that fails to decode is not kept."""

    def __init__(self, kept: int) -> None:
        self._kept = kept
        self._lock = threading.Lock()
        self._by_digest: collections.OrderedDict[str, Manifest] = collections.OrderedDict()

    def get(self, digest: str, data: bytes, where: str) -> Manifest:
        with self._lock:
            found = self._by_digest.get(digest)
            if found is not None:
                self._by_digest.move_to_end(digest)
                return found
        manifest = decode_manifest(data, where)
        self.put(digest, manifest)
        return manifest

    def put(self, digest: str, manifest: Manifest) -> None:
        with self._lock:
            self._by_digest[digest] = manifest
            self._by_digest.move_to_end(digest)
            while len(self._by_digest) > self._kept:
                self._by_digest.popitem(last=False)


_decoded = _Decoded(DECODED_KEPT)


@dataclasses.dataclass(frozen=True)
class StepListing:
    committed: list[int]
    incomplete: list[int]  # a step directory without COMMIT: a crashed or in-flight save


def list_steps(storage: Storage) -> StepListing:
    committed, incomplete = [], []
    for name, inside in storage.list_dirs("", only=lambda name: naming.parse_step_dir(name) is not None).items():
        step = naming.parse_step_dir(name)
        assert step is not None
        if naming.COMMIT_NAME in inside or _linked(storage, naming.commit_name(step)):
            committed.append(step)  # a linked COMMIT too: readers report it damaged, tidying leaves it alone
        elif inside or plain_object(storage, name) is not True:  # a file of a step's name (no more) is a user's: left alone
            incomplete.append(step)
    return StepListing(sorted(committed), sorted(incomplete))


def plain_object(storage: Storage, path: str) -> bool | None:
    """Whether `path` is a file (an object: a user's, which no save made, at a step's name) rather than a
    directory or nothing; None when the storage could not tell (callers about to delete leave it alone)."""
    try:
        storage.size(path)
    except FileNotFoundError:  # a directory, gone, or a link LocalStorage does not follow
        return False
    except OSError:
        return None
    return True


def _linked(storage: Storage, path: str) -> bool:
    """Whether `path` is a symbolic link the storage refuses to follow (LocalStorage)."""
    try:
        storage.size(path)
    except SymlinkSkipped:
        return True
    except OSError:
        pass
    return False


def read_commit(storage: Storage, step: int) -> CommitMarker:
    path = naming.commit_name(step)
    where = f"{storage.url}/{path}"
    try:
        data = storage.get(path, max_bytes=MAX_COMMIT_BYTES)
    except SymlinkSkipped as exc:
        raise CheckpointCorruptError(f"step {step}: {exc}; remove that step directory") from None
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"step {step} is not committed in {storage.url} (no {path})") from None
    try:
        marker = decode_commit(data, where)
    except ManifestError as exc:
        raise ManifestError(f"step {step}: {exc}; the step cannot be read: use another step (step=N; CLI: --step N), "
                            f"or delete it (checkpointing rm DIR --step {step} --force)") from None
    if marker.step != step:
        raise ManifestError(f"{where} names step {marker.step}, expected {step}")
    if not marker.manifest.startswith(naming.step_dir(step) + "/"):
        raise ManifestError(f"{where} names manifest {marker.manifest!r} outside its step directory")
    return marker


def unreadable_commit(storage: Storage, step: int) -> str | None:
    """For a step listed as incomplete: why its COMMIT entry, present but no object (a symbolic
    link, never followed), cannot be read; None when there is simply no COMMIT."""
    try:
        storage.size(naming.commit_name(step))
    except SymlinkSkipped as exc:
        return f"its COMMIT is not a regular file ({exc}): the step cannot be read; remove the step directory"
    except FileNotFoundError:
        return None
    except (CheckpointError, OSError) as exc:
        return f"its COMMIT cannot be read ({exc})"
    return None


def load_manifest(storage: Storage, step: int) -> Manifest:
    """The committed manifest of `step`, its digest checked against the commit marker."""
    return committed_manifest(storage, step)[0]


def committed_manifest(storage: Storage, step: int) -> tuple[Manifest, str]:
    """The committed manifest of `step` and the digest its commit marker names (checked)."""
    marker = read_commit(storage, step)
    where = f"{storage.url}/{marker.manifest}"
    try:
        data = storage.get(marker.manifest, max_bytes=MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        raise CheckpointCorruptError(f"step {step}: manifest {where} named by COMMIT is missing") from None
    digest = manifest_digest(data)
    if digest != marker.manifest_digest:
        raise CheckpointCorruptError(
            f"step {step}: manifest {where} is damaged (sha256 {digest[7:19]}... != "
            f"{marker.manifest_digest[7:19]}... in COMMIT); use another step (step=N; CLI: --step N)"
        )
    manifest = _decoded.get(digest, data, where)
    if manifest.step != step:
        raise ManifestError(f"{where} is for step {manifest.step}, expected {step}")
    return manifest, digest


def decoded_manifest(data: bytes, where: str, digest: str | None = None) -> Manifest:
    """decode_manifest(data), kept by digest with the committed manifests this process read or wrote
    (`digest`: manifest_digest(data), where the caller has it already)."""
    return _decoded.get(digest or manifest_digest(data), data, where)


def commit(storage: Storage, manifest: Manifest, token: str) -> str:
    """Write the manifest, then the COMMIT marker (exclusive create: a step commits once); returns
    the manifest's digest as the marker names it."""
    return commit_bytes(storage, manifest.step, encode_manifest(manifest), token)


def commit_bytes(storage: Storage, step: int, data: bytes, token: str, decoded: Manifest | None = None) -> str:
    """commit() for a manifest already encoded (every tier stores the very same bytes). `decoded`:
    what decode_manifest(data) returned, where the caller has it (rank_reports.merge_parts), so that
    it is not decoded again; it is kept for the next saves' retention, which reads this step again."""
    path = naming.manifest_name(step, token)
    storage.put(path, data)
    digest = manifest_digest(data)
    if decoded is not None:
        _decoded.put(digest, decoded)
    manifest = _decoded.get(digest, data, f"step {step} manifest")
    check_files(storage, manifest)  # the last moment before COMMIT
    marker = CommitMarker(step, path, digest, metrics=manifest.metrics)  # listed without reading the manifest
    storage.put(naming.commit_name(step), encode_commit(marker), exclusive=True)
    return marker.manifest_digest


def check_files(storage: Storage, manifest: Manifest) -> None:
    """Before a COMMIT: every data file the manifest places on this tier is there with its size
    (another process may have deleted one under the writer); else the step must not commit."""
    tier = read_tier_id(storage)
    for path, found, expected in size_mismatches(storage, [(f.path, f.nbytes) for f in manifest.files if tier is None or f.tier == tier]):
        what = "is missing" if found is None else f"has {found} bytes, not {expected}"
        raise CheckpointCorruptError(
            f"step {manifest.step} was not committed: its data file {storage.url}/{path} {what} (deleted or changed "
            "while it was written: is another process using this directory?); the step is left uncommitted, save again"
        )


def size_mismatches(storage: Storage, expected: Iterable[tuple[str, int]]) -> Iterator[tuple[str, int | None, int]]:
    """(path, size found or None when missing, size expected) for each object that does not have its
    expected size (Storage.sizes: an object store lists each directory rather than asking per object)."""
    expected = list(expected)
    found = storage.sizes([path for path, _ in expected])
    for path, nbytes in expected:
        if found[path] != nbytes:
            yield path, found[path], nbytes


def step_infos(storage: Storage, steps: Iterable[int], *, metrics: bool) -> list[StepInfo]:
    """The committed `steps` as retention sees them; with `metrics`, each with the metrics its COMMIT
    records (one small read per step). A step whose COMMIT is damaged has none; an OSError (the tier
    cannot be read now) is the caller's."""
    if not metrics:
        return [StepInfo(s) for s in steps]
    out = []
    for s in steps:
        try:
            out.append(StepInfo(s, read_commit(storage, s).metrics))
        except CheckpointError as exc:
            log.debug("checkpointing: step %d in %s has no readable metrics: %s", s, storage.url, exc)
            out.append(StepInfo(s))
    return out


def committed_digest(storage: Storage, step: int) -> str | None:
    """The manifest digest `step`'s COMMIT names, or None when the step is not committed (or its
    marker cannot be read)."""
    try:
        return read_commit(storage, step).manifest_digest
    except (CheckpointError, OSError):
        return None


def copy_commit(src: Storage, dst: Storage, step: int) -> None:
    """Commit `step` on `dst` as it is committed on `src`: the same manifest bytes, then the same
    COMMIT bytes with an exclusive create (the data files must be on `dst` already).

    A COMMIT already on `dst` with exactly these bytes is ours (an earlier attempt whose answer was
    lost); any other one belongs to another writer: CommitConflictError, and `dst` is left as it is.
    """
    name = naming.commit_name(step)
    marker_bytes = src.get(name)
    marker = read_commit(src, step)
    data = src.get(marker.manifest)
    if manifest_digest(data) != marker.manifest_digest:
        raise CheckpointCorruptError(f"step {step}: manifest {src.url}/{marker.manifest} does not match its COMMIT; not copied to {dst.url}")
    dst.put(marker.manifest, data)
    try:
        dst.put(name, marker_bytes, exclusive=True)
    except FileExistsError:
        try:
            existing = dst.get(name)
        except FileNotFoundError:
            existing = b""
        if existing != marker_bytes:
            raise CommitConflictError(
                f"step {step} is already committed in {dst.url} by another writer (its COMMIT names another manifest); "
                "two jobs are saving into one remote prefix: give each run its own prefix"
            ) from None
