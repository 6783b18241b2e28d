"""The steps on one tier: list them, read a committed step's manifest, commit, delete (I/O).

A step is committed only when its COMMIT marker exists and names a manifest whose sha256 matches.
Write order: pack data -> manifest -> COMMIT. Delete order: COMMIT -> manifest -> data.
"""

from __future__ import annotations

import dataclasses
import logging

from . import layout
from .errors import CheckpointCorruptError, CheckpointNotFoundError, ManifestError
from .manifest import CommitMarker, Manifest, decode_commit, decode_manifest, encode_commit, encode_manifest, manifest_digest
from .storage import Storage

log = logging.getLogger("checkpointing")


@dataclasses.dataclass(frozen=True)
class StepListing:
    committed: list[int]
    incomplete: list[int]  # a step directory without COMMIT: a crashed or in-flight save


def list_steps(storage: Storage) -> StepListing:
    committed, incomplete = [], []
    for name in storage.list(""):
        step = layout.parse_step_dir(name)
        if step is None:
            continue
        if layout.COMMIT_NAME in storage.list(name):
            committed.append(step)
        else:
            incomplete.append(step)
    return StepListing(sorted(committed), sorted(incomplete))


def read_commit(storage: Storage, step: int) -> CommitMarker:
    path = layout.commit_name(step)
    where = f"{storage.url}/{path}"
    try:
        data = storage.get(path)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"step {step} is not committed in {storage.url} (no {path})") from None
    marker = decode_commit(data, where)
    if marker.step != step:
        raise ManifestError(f"{where} names step {marker.step}, expected {step}")
    if not marker.manifest.startswith(layout.step_dir(step) + "/"):
        raise ManifestError(f"{where} names manifest {marker.manifest!r} outside its step directory")
    return marker


def load_manifest(storage: Storage, step: int) -> Manifest:
    """The committed manifest of `step`, its digest checked against the commit marker."""
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
    return manifest


def commit(storage: Storage, manifest: Manifest, token: str) -> None:
    """Write the manifest, then the COMMIT marker (exclusive create: a step commits once)."""
    commit_bytes(storage, manifest.step, encode_manifest(manifest), token)


def commit_bytes(storage: Storage, step: int, data: bytes, token: str) -> None:
    """commit() for a manifest already encoded (every tier stores the very same bytes)."""
    path = layout.manifest_name(step, token)
    storage.put(path, data)
    marker = CommitMarker(step, path, manifest_digest(data))
    storage.put(layout.commit_name(step), encode_commit(marker), exclusive=True)


def delete_step(storage: Storage, step: int) -> None:
    """Remove a step in reverse write order: COMMIT first, so a crash leaves an incomplete step, never a broken one."""
    sdir = layout.step_dir(step)
    storage.delete(layout.commit_name(step))
    for name in storage.list(sdir):
        if name.startswith("manifest."):
            storage.delete(f"{sdir}/{name}")
    storage.delete(sdir)


def apply_retention(storage: Storage, keep: int | None, *, protect: int | None = None) -> list[int]:
    """Delete committed steps beyond the newest `keep`; returns the deleted steps."""
    if keep is None:
        return []
    from .retention import steps_to_delete

    doomed = steps_to_delete(list_steps(storage).committed, keep, protect=protect)
    for step in doomed:
        try:
            delete_step(storage, step)
        except OSError as exc:  # one failed delete must not stop training; retried after the next save
            log.warning("checkpointing: could not delete step %d from %s: %s", step, storage.url, exc)
    return doomed
