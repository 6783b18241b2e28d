"""Incremental saves: which chunks a save can take from the step before it instead of writing them (pure).

A rank's previous committed save leaves two things behind: its staging pool still holds the bytes
it saved (the pool is the pack's image, reused from save to save), and its manifest says where
each of those chunks is stored. The next save with the same pack plan compares each chunk's live
bytes with the pool before copying (staging.Copier.stage_chunk): equal bytes are neither copied
nor written, and the new manifest refers to the stored chunk; different bytes are copied and
written as usual. The test is byte-for-byte (memcmp), so it is exact; CUDA tensors, whose live
bytes are not in host memory, are compared by their 128-bit chunk digest after the copy instead.

A chunk is referenced, never copied from file to file: a reference always points at the file that
holds the bytes, so there are no chains to follow and a restore reads only retained files. A file
stays on disk while any retained step references any chunk of it (gc.py); so that a few live
chunks cannot keep a large file alive for ever, a save rewrites the chunks it would take from a
file if they are less than `REWRITE_BELOW` of that file's bytes: what is kept of earlier saves is
then at most about twice what the retained steps need.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from .manifest import ChunkRef, FileEntry, Manifest
from .plan import PackPlan

REWRITE_BELOW = 0.5  # take chunks from a file only if they are at least this share of its bytes


@dataclasses.dataclass(frozen=True)
class ReuseBase:
    """What a rank's last committed save left in its staging pool and where it is stored."""

    plan: PackPlan  # the save used this very plan object (same leaves, sizes, order, pool layout)
    pool_generation: int  # StagingPool.allocations then: a reallocated pool holds nothing
    step: int
    manifest_digest: str  # the sha256 its COMMIT names: the step is still committed iff it still matches
    digests: tuple[str, ...]  # per placement: the digest of the bytes the pool holds there
    refs: tuple[ChunkRef | None, ...]  # per placement: where the committed step stores them (None: nowhere this rank can use)
    files: Mapping[str, FileEntry]  # the file-table entry of every file `refs` names

    def usable(self, plan: PackPlan, pool_generation: int) -> bool:
        return plan is self.plan and pool_generation == self.pool_generation


def base_after_save(
    plan: PackPlan, pool_generation: int, manifest: Manifest, manifest_digest: str, digests: list[str], refs: list[ChunkRef | None]
) -> ReuseBase:
    """The base for the next save, once `manifest` is committed. A reference into a file the
    manifest does not list is dropped: nothing keeps that file alive."""
    files = {f.path: f for f in manifest.files}
    kept = tuple(r if r is not None and r.file in files else None for r in refs)
    used = {r.file for r in kept if r is not None}
    return ReuseBase(plan, pool_generation, manifest.step, manifest_digest, tuple(digests), kept,
                     {p: f for p, f in files.items() if p in used})


def choose_borrowed(base: ReuseBase, same: list[bool], wanted: list[bool]) -> list[bool]:
    """Per placement: take the stored chunk (True) or write it. `same`: the bytes equal the base's;
    `wanted`: this rank stores the chunk in this save. Files whose usable chunks fall below
    REWRITE_BELOW of their size are rewritten instead of kept alive."""
    candidates = [w and s and base.refs[i] is not None for i, (s, w) in enumerate(zip(same, wanted))]
    live: dict[str, int] = {}
    for i, c in enumerate(candidates):
        if c:
            ref = base.refs[i]
            assert ref is not None
            live[ref.file] = live.get(ref.file, 0) + ref.length
    keep = {f for f, n in live.items() if n >= REWRITE_BELOW * base.files[f].nbytes}
    return [c and base.refs[i].file in keep for i, c in enumerate(candidates)]  # type: ignore[union-attr]
