"""Incremental saves: which chunks a save can take from the step before it instead of writing them (pure).

A rank's previous committed save leaves two things behind: its staging pool still holds the bytes
it saved (the pool is the pack's image, reused from save to save), and its manifest says where
each of those chunks is stored. The next save with the same pack plan compares each chunk's live
bytes with the pool before copying (staging.Copier.stage_chunk): equal bytes are neither copied
nor written, and the new manifest refers to the stored chunk; different bytes are copied and
written as usual. The test is byte-for-byte (memcmp), so it is exact. Where the pool cannot hold
the previous bytes at the same place (CUDA tensors, whose live bytes reach host memory only through
the copy; a plan that changed, e.g. once the ranks learn which tensors differ between them; a
reallocated pool) a chunk is matched to the previous save's chunk at the same place (tensor key,
where its shard starts, byte offset, length) and compared by its 128-bit digest after the copy.
A restored step serves the first save after a restart the same way (`base_after_restore`): its
manifest names the place and digest of every chunk.

A chunk is referenced, never copied from file to file: a reference always points at the file that
holds the bytes, so there are no chains to follow and a restore reads only retained files. A file
stays on disk while any retained step references any chunk of it (tier/collect.py); so that a few live
chunks cannot keep a large file alive for ever, a save rewrites the chunks it would take from a
file if they are less than `REWRITE_BELOW` of that file's bytes: what is kept of earlier saves is
then at most about twice what the retained steps need.
"""

from __future__ import annotations

import dataclasses
from typing import Collection, Mapping

from checkpointing.format.manifest import ChunkRef, CommittedStep, FileEntry, Manifest
from checkpointing.plan.pack import PackPlan

REWRITE_BELOW = 0.5  # take chunks from a file only if they are at least this share of its bytes

PlaceKey = tuple[str, tuple[int, ...], int, int]  # tensor key, shard_place, byte offset in the shard, length


def shard_place(offsets: tuple[int, ...] | None) -> tuple[int, ...]:
    """Where a shard starts in its global tensor, for matching chunks by place: () for a whole tensor
    or a shard at the origin (so a reshape to another rank of dimensions still matches)."""
    return tuple(offsets) if offsets and any(offsets) else ()


@dataclasses.dataclass(frozen=True)
class ReuseBase:
    """What a rank's last committed save left in its staging pool and where it is stored."""

    plan: PackPlan | None  # the save used this very plan object (same leaves, sizes, order, pool layout); None: no save
    pool_generation: int  # StagingPool.allocations then: a reallocated pool holds nothing
    step: int
    manifest_digest: str  # the sha256 its COMMIT names: the step is still committed iff it still matches
    digests: tuple[str, ...]  # per placement: the digest of the bytes the pool holds there
    refs: tuple[ChunkRef | None, ...]  # per placement: where the committed step stores them (None: nowhere this rank can use)
    files: Mapping[str, FileEntry]  # the file-table entry of every file `refs` names
    keys: tuple[PlaceKey, ...] = ()  # per placement: its place (writer.placement_keys)

    def without(self, damaged: Collection[tuple[str, int, int, str]]) -> "ReuseBase":
        """This base less the chunks `damaged` names (plan/scrub.py chunk ids: file, offset, length,
        digest; found damaged by re-verification): the next save writes them anew."""
        refs = tuple(None if r is not None and (r.file, r.offset, r.length, r.digest) in damaged else r for r in self.refs)
        return self if refs == self.refs else dataclasses.replace(self, refs=refs)

    def against(self, plan: PackPlan, pool_generation: int, keys: list[PlaceKey]) -> "Match":
        """The base seen from a save with `plan`: per placement of that plan, the previous digest
        and stored chunk of the same bytes' position (None where there is none)."""
        if plan is self.plan and pool_generation == self.pool_generation:
            return Match(True, list(self.digests), list(self.refs))
        index = {k: j for j, k in enumerate(self.keys)}
        found = [index.get(k) for k in keys]
        return Match(False, [None if j is None else self.digests[j] for j in found], [None if j is None else self.refs[j] for j in found])


@dataclasses.dataclass(frozen=True)
class Match:
    exact: bool  # the pool holds the previous bytes where this plan stages them: compare bytes
    digests: list[str | None]
    refs: list[ChunkRef | None]


def base_after_save(
    plan: PackPlan, pool_generation: int, committed: CommittedStep, digests: list[str], refs: list[ChunkRef | None], keys: list[PlaceKey],
) -> ReuseBase:
    """The base for the next save, once `committed`. A reference into a file its manifest does not
    list is dropped: nothing keeps that file alive."""
    files = {f.path: f for f in committed.files}
    kept = tuple(r if r is not None and r.file in files else None for r in refs)
    used = {r.file for r in kept if r is not None}
    return ReuseBase(plan, pool_generation, committed.step, committed.digest, tuple(digests), kept,
                     {p: f for p, f in files.items() if p in used}, tuple(keys))


def base_after_restore(manifest: Manifest, manifest_digest: str, rank: int, tier: str) -> ReuseBase:
    """The base for the first save after restoring `manifest` (committed on this rank's local tier
    `tier` with `manifest_digest`): each chunk stored in a file this rank wrote on that tier, at its
    place. The pool holds none of these bytes, so that save matches chunks by place and compares
    digests after the copy (`against`): a restarted fine-tuning job writes only what changed."""
    files = {f.path: f for f in manifest.files if f.rank == rank and f.tier == tier}
    keys: list[PlaceKey] = []
    digests: list[str] = []
    refs: list[ChunkRef] = []
    for entry in manifest.tensors:
        for shard in entry.shards:
            copy = next((c for c in shard.copies() if c and all(r.file in files for r in c)), None)
            offset = 0
            for ref in copy or ():
                keys.append((entry.key, shard_place(shard.offsets), offset, ref.length))
                digests.append(ref.digest)
                refs.append(ref)
                offset += ref.length
    used = {r.file for r in refs}
    return ReuseBase(None, -1, manifest.step, manifest_digest, tuple(digests), tuple(refs),
                     {p: f for p, f in files.items() if p in used}, tuple(keys))


def choose_borrowed(refs: list[ChunkRef | None], files: Mapping[str, FileEntry], same: list[bool], wanted: list[bool],
                    primary: list[bool] | None = None) -> list[bool]:
    """Per placement: take the stored chunk `refs[i]` (True) or write it. `same`: the bytes equal
    the stored ones; `wanted`: this rank stores the chunk in this save; `primary`: this rank's copy
    may become the step's primary copy (regions UNIQUE and PRIMARY), which the remote tier must
    hold: such a chunk is taken only from inside its file's `primary_bytes` (a copy the earlier save
    kept only on its local tier, past that prefix, is written again). Files whose usable chunks
    fall below REWRITE_BELOW of their size are rewritten instead of kept alive."""
    candidates = [w and s and refs[i] is not None and (primary is None or not primary[i] or _in_prefix(refs[i], files))
                  for i, (s, w) in enumerate(zip(same, wanted))]
    live: dict[str, int] = {}
    for i, c in enumerate(candidates):
        if c:
            ref = refs[i]
            assert ref is not None
            live[ref.file] = live.get(ref.file, 0) + ref.length
    keep = {f for f, n in live.items() if n >= REWRITE_BELOW * files[f].nbytes}
    return [c and refs[i].file in keep for i, c in enumerate(candidates)]  # type: ignore[union-attr]


def _in_prefix(ref: ChunkRef | None, files: Mapping[str, FileEntry]) -> bool:
    entry = files.get(ref.file) if ref is not None else None
    return entry is not None and ref.offset + ref.length <= entry.primary_bytes  # type: ignore[union-attr]
