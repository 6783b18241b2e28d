"""The steps on one tier: list them, read a committed step's manifest, commit (I/O).

A step is committed only when its COMMIT marker exists and names a manifest whose sha256 matches.
Write order: pack data -> manifest -> COMMIT. Deleting (retention, gc) is collect.py's: COMMIT first,
then whatever no committed step or save in flight references.
"""

from __future__ import annotations

import dataclasses
import logging

from checkpointing.format import naming
from checkpointing.errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError, CommitConflictError, ManifestError
from checkpointing.format.decode import decode_commit, decode_manifest
from checkpointing.format.manifest import CommitMarker, Manifest, encode_commit, encode_manifest, manifest_digest
from checkpointing.storage import Storage

log = logging.getLogger("checkpointing")


@dataclasses.dataclass(frozen=True)
class StepListing:
    committed: list[int]
    incomplete: list[int]  # a step directory without COMMIT: a crashed or in-flight save


def list_steps(storage: Storage) -> StepListing:
    committed, incomplete = [], []
    for name in storage.list(""):
        step = naming.parse_step_dir(name)
        if step is None:
            continue
        if naming.COMMIT_NAME in storage.list(name):
            committed.append(step)
        else:
            incomplete.append(step)
    return StepListing(sorted(committed), sorted(incomplete))


def read_commit(storage: Storage, step: int) -> CommitMarker:
    path = naming.commit_name(step)
    where = f"{storage.url}/{path}"
    try:
        data = storage.get(path)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"step {step} is not committed in {storage.url} (no {path})") from None
    marker = decode_commit(data, where)
    if marker.step != step:
        raise ManifestError(f"{where} names step {marker.step}, expected {step}")
    if not marker.manifest.startswith(naming.step_dir(step) + "/"):
        raise ManifestError(f"{where} names manifest {marker.manifest!r} outside its step directory")
    return marker


def load_manifest(storage: Storage, step: int) -> Manifest:
    """The committed manifest of `step`, its digest checked against the commit marker."""
    return committed_manifest(storage, step)[0]


def committed_manifest(storage: Storage, step: int) -> tuple[Manifest, str]:
    """The committed manifest of `step` and the digest its commit marker names (checked)."""
    marker = read_commit(storage, step)
    where = f"{storage.url}/{marker.manifest}"
    try:
        data = storage.get(marker.manifest)
    except FileNotFoundError:
        raise CheckpointCorruptError(f"step {step}: manifest {where} named by COMMIT is missing") from None
    digest = manifest_digest(data)
    if digest != marker.manifest_digest:
        raise CheckpointCorruptError(
            f"step {step}: manifest {where} is damaged (sha256 {digest[7:19]}... != "
            f"{marker.manifest_digest[7:19]}... in COMMIT); restore another step (restore(step=...))"
        )
    manifest = decode_manifest(data, where)
    if manifest.step != step:
        raise ManifestError(f"{where} is for step {manifest.step}, expected {step}")
    return manifest, digest


def commit(storage: Storage, manifest: Manifest, token: str) -> str:
    """Write the manifest, then the COMMIT marker (exclusive create: a step commits once); returns
    the manifest's digest as the marker names it."""
    return commit_bytes(storage, manifest.step, encode_manifest(manifest), token)


def commit_bytes(storage: Storage, step: int, data: bytes, token: str) -> str:
    """commit() for a manifest already encoded (every tier stores the very same bytes)."""
    path = naming.manifest_name(step, token)
    storage.put(path, data)
    marker = CommitMarker(step, path, manifest_digest(data))
    storage.put(naming.commit_name(step), encode_commit(marker), exclusive=True)
    return marker.manifest_digest


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
