"""What each rank reports after writing, and how rank 0 merges the reports into one manifest (pure).

A rank's part lists, for every leaf it saved: its key, dtype, local shape, DTensor layout (global
shape and offsets) if any, a digest of its bytes, and the chunk references where this rank wrote
it (None when a peer on its local tier wrote the same bytes). The merge:

- gathers the shards of each DTensor key, checks dtype and global shape agree, that replicas of a
  shard hold the same bytes, and that the shards tile the global tensor (no overlap, no hole); one
  key on several meshes is one tensor when their bytes agree shard for shard (a sub-mesh DTensor
  replicated across the other mesh dimensions), else one per mesh (pipeline stages);
- stores a plain tensor once per distinct content: ranks that saved equal bytes under one key
  share one entry (replicated state), ranks that differ get their own (per-rank state);
- checks every leaf has a copy on its rank's local tier, picks one primary copy per shard (what the
  remote tier needs) and keeps one replica per other tier;
- rewrites each rank's tree to the merged tensor indices and stores each distinct tree once.
Everything that is wrong is collected and raised together.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import xxhash

from checkpointing.errors import ManifestError, MergeError
from checkpointing.format.decode import decode_manifest
from checkpointing.format.handoff import handoff
from checkpointing.format.naming import step_dir
from checkpointing.format.manifest import (ChunkRef, FileEntry, Manifest, Metrics, ShardEntry, TensorEntry, canonical_json, encode_files,
                                           encode_manifest)
from checkpointing.format.tiling import check_tiling


@dataclasses.dataclass(frozen=True)
class PartLeaf:
    key: str
    dtype: str
    shape: tuple[int, ...]  # local shape
    global_shape: tuple[int, ...] | None  # set for DTensor shards
    offsets: tuple[int, ...] | None
    digest: str  # of dtype, shape and every chunk digest: equal bytes <=> equal digest
    region: int  # assign.UNIQUE / PRIMARY / TIER / OTHER
    chunks: tuple[tuple[str, int, int, str], ...] | None  # (file, offset, length, digest); None: a peer wrote it
    mesh: tuple[int, ...] = ()  # a DTensor shard's mesh (its ranks): one key on two meshes is two tensors (pipeline stages), unless their bytes agree


@dataclasses.dataclass(frozen=True)
class RankPart:
    rank: int
    file: str
    nbytes: int  # size of the file
    tree: dict[str, Any]
    leaves: tuple[PartLeaf, ...]
    borrowed: tuple[FileEntry, ...] = ()  # files of earlier steps this part takes chunks from (their entries, unchanged)


def leaf_digest(dtype: str, shape: tuple[int, ...], chunk_digests: list[str]) -> str:
    return xxhash.xxh3_128(canonical_json([dtype, list(shape), chunk_digests])).hexdigest()


def encode_part(part: RankPart) -> bytes:
    """The report's JSON. Each mesh and each file is spelled once, in the tables `meshes` and
    `files`, and leaves and chunks name them by index: a DTensor's mesh lists every rank of it, so
    spelled per leaf the reports would grow with the square of the job (N ranks x N-rank meshes)."""
    mesh_index: dict[int, int] = {}  # id(mesh tuple) -> index: leaves of one layout share their tuple, hashed once here
    meshes: dict[tuple[int, ...], int] = {}
    files: dict[str, int] = {}

    def mesh_of(mesh: tuple[int, ...]) -> int:
        i = mesh_index.get(id(mesh))
        if i is None:
            i = mesh_index[id(mesh)] = meshes.setdefault(mesh, len(meshes))
        return i

    leaves = [
        [l.key, l.dtype, list(l.shape), None if l.global_shape is None else [list(l.global_shape), list(l.offsets or ())], l.digest, l.region,
         None if l.chunks is None else [[files.setdefault(f, len(files)), o, n, d] for f, o, n, d in l.chunks], mesh_of(l.mesh)]
        for l in part.leaves
    ]
    return canonical_json(
        {
            "rank": part.rank,
            "file": part.file,
            "nbytes": part.nbytes,
            "tree": part.tree,
            "meshes": [list(m) for m in meshes],
            "files": list(files),
            "leaves": leaves,
            "borrowed": encode_files(part.borrowed),
        }
    )


def decode_part(data: bytes) -> RankPart:
    """Parts come from our own ranks over the store; a malformed one is a bug, reported as ManifestError."""
    try:
        obj = json.loads(data)
    except ValueError as exc:
        raise ManifestError(f"a rank's save report is malformed ({type(exc).__name__}: {exc})") from None
    return part_from(obj)


def part_from(obj: Any) -> RankPart:
    """decode_part of the report's JSON, parsed already (the coordinator reads its `ok` first).
    Leaves on one mesh share one tuple and chunks in one file one string (merge_parts relies on the former)."""
    try:
        meshes = [tuple(int(r) for r in m) for m in obj["meshes"]]
        files = [str(f) for f in obj["files"]]
        leaves = tuple(
            PartLeaf(k, dt, tuple(shape), None if g is None else tuple(g[0]), None if g is None else tuple(g[1]), dig, region,
                     None if chunks is None else tuple((files[f], int(o), int(n), str(d)) for f, o, n, d in chunks), meshes[mesh])
            for k, dt, shape, g, dig, region, chunks, mesh in obj["leaves"]
        )
        borrowed = tuple(FileEntry(str(p), int(r), str(t), int(n), int(pb)) for p, r, t, n, pb in obj.get("borrowed", []))
        return RankPart(int(obj["rank"]), str(obj["file"]), int(obj["nbytes"]), obj["tree"], leaves, borrowed)
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
        raise ManifestError(f"a rank's save report is malformed ({type(exc).__name__}: {exc})") from None


@dataclasses.dataclass
class _Shard:
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    digest: str
    copies: list[tuple[int, int, tuple[ChunkRef, ...]]] = dataclasses.field(default_factory=list)  # (preference, rank, chunks)


@dataclasses.dataclass
class _Entry:
    key: str
    dtype: str
    shape: tuple[int, ...]
    shards: dict[tuple[int, ...], _Shard] = dataclasses.field(default_factory=dict)


def merge_parts(step: int, parts: list[RankPart], tiers: tuple[str, ...], metrics: Metrics | None = None) -> tuple[Manifest, bytes, frozenset[str]]:
    """The step's manifest as a reader decodes it, its encoding (the bytes every tier commits), and
    the plain-tensor keys whose values differ between ranks. `metrics`: the save's (rank 0's
    save(..., metrics=...): the merging rank's own), recorded in the manifest."""
    world = len(parts)
    others = {p.rank: p.file.split("/", 1)[0] for p in parts if p.file.split("/", 1)[0] != step_dir(step)}
    if others:  # its files lie in that step's directory, which goes when that save fails: a step that cannot be read
        raise MergeError([f"ranks passed different steps to save(): rank 0 step {step}, " + ", ".join(
            f"rank {r} {d.removeprefix('step-').lstrip('0') or '0'}" for r, d in sorted(others.items())) +
            " (every rank must save the same step: a rank skipped a save, or counts its steps otherwise)"])
    problems: list[str] = []
    entries: list[_Entry] = []
    index: dict[tuple, int] = {}
    leaf_map: list[list[int]] = []
    plain_digests: dict[str, dict[str, list[int]]] = {}  # key -> digest -> ranks
    ident = _Idents()
    for part in parts:
        mapping = []
        for leaf in part.leaves:
            handoff()
            which = ident(leaf)
            if leaf.global_shape is not None:
                shape = leaf.global_shape
            else:
                shape = leaf.shape
                plain_digests.setdefault(leaf.key, {}).setdefault(leaf.digest, []).append(part.rank)
            if which not in index:
                index[which] = len(entries)
                entries.append(_Entry(leaf.key, leaf.dtype, shape))
            entry = entries[index[which]]
            mapping.append(index[which])
            if (entry.dtype, entry.shape) != (leaf.dtype, shape):
                problems.append(
                    f"{leaf.key}: rank {part.rank} saved {leaf.dtype}{list(shape)}, another rank {entry.dtype}{list(entry.shape)} "
                    "(a DTensor must have one dtype and global shape on every rank)"
                )
                continue
            _add_shard(entry, leaf, part, problems)
        leaf_map.append(mapping)
    entries = _join_replicated_meshes(entries, index, leaf_map)
    _check_local_copies(parts, entries, index, ident, tiers, problems)
    tensors, primary_end = _finish_entries(entries, parts, tiers, problems)
    if problems:
        raise MergeError(problems)
    trees, rank_trees = _distinct_trees(parts, leaf_map)
    files = _file_table(parts, tensors, tiers, primary_end, problems)
    if problems:
        raise MergeError(problems)
    merged = Manifest(step=step, trees=tuple(trees), tensors=tuple(tensors), world_size=world, rank_trees=tuple(rank_trees), files=files,
                      metrics=dict(metrics or {}))
    data = encode_manifest(merged)
    try:  # what is committed must decode: the reader's own checks, once, here; the writer goes on with what they return
        manifest = decode_manifest(data, f"step {step} manifest")
    except ManifestError as exc:
        raise MergeError([str(exc)]) from None
    per_rank = frozenset(k for k, by_digest in plain_digests.items() if len(by_digest) > 1 or sum(map(len, by_digest.values())) != world)
    return manifest, data, per_rank


def _join_replicated_meshes(entries: list[_Entry], index: dict[tuple, int], leaf_map: list[list[int]]) -> list[_Entry]:
    """One DTensor key on several meshes whose bytes agree shard for shard is one tensor with more
    copies: a DTensor on a sub-mesh, replicated across the job's other mesh dimensions (FSDP over
    the dp dimension, tensor parallelism beside it, a parameter TP leaves alone: each TP rank's dp
    group holds it whole). Keys whose meshes hold other bytes stay apart (pipeline stages).
    Rewrites `index` and `leaf_map` to the entries kept."""
    dtensors = {i for which, i in index.items() if which[0] == "dtensor"}
    first: dict[tuple, int] = {}
    target = list(range(len(entries)))
    for i in sorted(dtensors):
        e = entries[i]
        handoff()
        layout = (e.key, e.dtype, e.shape, frozenset((o, s.shape, s.digest) for o, s in e.shards.items()))
        j = first.setdefault(layout, i)
        if j != i:
            for o, shard in e.shards.items():
                entries[j].shards[o].copies.extend(shard.copies)
            target[i] = j
    if all(t == i for i, t in enumerate(target)):
        return entries
    kept = [i for i, t in enumerate(target) if t == i]
    number = {old: n for n, old in enumerate(kept)}
    remap = [number[t] for t in target]
    for mapping in leaf_map:
        mapping[:] = [remap[x] for x in mapping]
    for which, i in index.items():
        index[which] = remap[i]
    return [entries[i] for i in kept]


def _distinct_trees(parts: list[RankPart], leaf_map: list[list[int]]) -> tuple[list[dict[str, Any]], list[int]]:
    """Each rank's tree rewritten to the merged tensor indices; each distinct tree once, and which one each rank has."""
    trees: list[dict[str, Any]] = []
    seen: dict[bytes, int] = {}
    rank_trees = []
    for part, mapping in zip(parts, leaf_map):
        handoff()
        tree = _remap(part.tree, mapping)
        key = canonical_json(tree)
        if key not in seen:
            seen[key] = len(trees)
            trees.append(tree)
        rank_trees.append(seen[key])
    return trees, rank_trees


def _file_table(parts: list[RankPart], tensors: list[TensorEntry], tiers: tuple[str, ...], primary_end: dict[str, int],
                problems: list[str]) -> tuple[FileEntry, ...]:
    """Each rank's new pack file, then the earlier steps' files the parts take chunks from, as
    their own manifests listed them (a file's entry never changes: the remote tier holds exactly
    its primary_bytes). Only files some chunk reference names are listed."""
    used: set[str] = set()
    for t in tensors:
        handoff()
        used.update(c.file for s in t.shards for copy in s.copies() for c in copy)
    files = [FileEntry(p.file, p.rank, tiers[p.rank], p.nbytes, primary_end.get(p.file, 0)) for p in parts if p.nbytes or p.file in primary_end]
    listed = {f.path for f in files}
    for part in parts:
        handoff()
        for f in part.borrowed:
            if f.path in listed or f.path not in used:
                continue
            listed.add(f.path)
            files.append(f)
            if primary_end.get(f.path, 0) > f.primary_bytes:
                problems.append(f"{f.path}: rank {part.rank} takes a primary copy from past its uploaded prefix ({f.primary_bytes} bytes)")
    missing = used - listed
    if missing:
        problems.append(f"chunk references name files no rank reported: {sorted(missing)[:5]}")
    return tuple(files)


def _add_shard(entry: _Entry, leaf: PartLeaf, part: RankPart, problems: list[str]) -> None:
    offsets = leaf.offsets if leaf.offsets is not None else (0,) * len(leaf.shape)
    if math.prod(leaf.shape) == 0 and math.prod(entry.shape) != 0:
        return  # an empty local shard (uneven sharding) holds nothing
    shard = entry.shards.get(offsets)
    if shard is None:
        shard = entry.shards[offsets] = _Shard(offsets, leaf.shape, leaf.digest)
    elif (shard.shape, shard.digest) != (leaf.shape, leaf.digest):
        problems.append(f"{leaf.key}: replicas of the shard at {list(offsets)} differ between ranks (rank {part.rank} holds other bytes)")
        return
    if leaf.chunks is not None:
        refs = tuple(ChunkRef(f, o, n, d) for f, o, n, d in leaf.chunks)
        preference = 0 if leaf.region <= 1 else 1  # a copy in the uploaded prefix of its file
        shard.copies.append((preference, part.rank, refs))


class _Idents:
    """Which tensor a leaf is part of: a DTensor's key on its mesh; a plain tensor's key and content.

    A mesh is named by a small number: its tuple lists every rank of it and Python does not cache
    a tuple's hash, so keying on the tuple itself would cost O(ranks) per leaf, O(ranks^2) per
    merge. part_from gives the leaves on one mesh one tuple object, so each is hashed once."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[tuple[int, ...], int]] = {}  # id(mesh) -> (the tuple, kept alive, its number)
        self._numbers: dict[tuple[int, ...], int] = {}

    def __call__(self, leaf: PartLeaf) -> tuple:
        if leaf.global_shape is None:
            return ("plain", leaf.key, leaf.digest)
        hit = self._by_id.get(id(leaf.mesh))
        if hit is None:
            hit = self._by_id[id(leaf.mesh)] = (leaf.mesh, self._numbers.setdefault(leaf.mesh, len(self._numbers)))
        return ("dtensor", leaf.key, hit[1])


def _check_local_copies(parts: list[RankPart], entries: list[_Entry], index: dict[tuple, int], ident: _Idents, tiers: tuple[str, ...],
                        problems: list[str]) -> None:
    for part in parts:
        handoff()
        for leaf in part.leaves:
            if leaf.chunks is not None:
                continue
            offsets = leaf.offsets if leaf.offsets is not None else (0,) * len(leaf.shape)
            shard = entries[index[ident(leaf)]].shards.get(offsets)
            if shard is None or not any(tiers[r] == tiers[part.rank] for _, r, _ in shard.copies):
                problems.append(f"{leaf.key}: rank {part.rank} skipped it for a peer on its local tier, and no peer there wrote it")


def _finish_entries(entries: list[_Entry], parts: list[RankPart], tiers: tuple[str, ...], problems: list[str]) -> tuple[list[TensorEntry], dict[str, int]]:
    tensors = []
    primary_end: dict[str, int] = {}
    for entry in entries:
        shards = []
        for shard in sorted(entry.shards.values(), key=lambda s: s.offsets):
            handoff()
            copies = sorted(shard.copies, key=lambda c: (c[0], c[1]))
            if not copies:
                problems.append(f"{entry.key}: no rank wrote the shard at {list(shard.offsets)}")
                continue
            primary = copies[0]
            replicas, tiers_seen = [], {tiers[primary[1]]}
            for _, rank, refs in copies[1:]:
                if tiers[rank] not in tiers_seen:
                    tiers_seen.add(tiers[rank])
                    replicas.append(refs)
            for c in primary[2]:
                primary_end[c.file] = max(primary_end.get(c.file, 0), c.offset + c.length)
            shards.append(ShardEntry(shard.offsets, shard.shape, primary[2], tuple(replicas)))
        numel = math.prod(entry.shape)
        covered = sum(math.prod(s.shape) for s in shards)
        if numel == 0 and not shards:
            shards.append(ShardEntry((0,) * len(entry.shape), entry.shape, ()))
        elif covered != numel:
            problems.append(f"{entry.key}: the ranks' shards cover {covered} of its {numel} elements (a rank did not save it?)")
            continue
        try:
            check_tiling(entry.shape, [(s.offsets, s.shape) for s in shards], entry.key)
        except ManifestError as exc:
            problems.append(str(exc))
            continue
        tensors.append(TensorEntry(entry.key, entry.dtype, entry.shape, tuple(shards)))
    if len(tensors) != len(entries):
        return [], primary_end  # problems were recorded; the indices no longer line up
    return tensors, primary_end


def _remap(node: Any, mapping: list[int]) -> Any:
    if isinstance(node, dict):
        if "tensor" in node and len(node) == 1:
            return {"tensor": mapping[node["tensor"]]}
        if "ndarray" in node and len(node) == 1:
            return {"ndarray": mapping[node["ndarray"]]}
        if "codec" in node:
            return node
        return {k: _remap(v, mapping) for k, v in node.items()}
    if isinstance(node, list):
        return [_remap(v, mapping) for v in node]
    return node
