"""The manifest and commit marker: frozen dataclasses, their canonical JSON and digests (layer: format, pure).

What a save writes. Reading it back, with strict validation, is decode.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Any, Mapping, Union

import xxhash

from checkpointing.format.dtypes import dtype_from_name, itemsize
from checkpointing.format.handoff import handoff

FORMAT_VERSION = 3
CHUNK_DIGEST = "xxh3-128"

Metrics = Mapping[str, Union[int, float]]  # save(..., metrics=...): finite numbers by name (decode.check_metrics)


@dataclasses.dataclass(frozen=True)
class ChunkRef:
    file: str  # relative to the tier root
    offset: int
    length: int
    digest: str  # "xxh3-128:<hex>" of the chunk's bytes


@dataclasses.dataclass(frozen=True)
class ShardEntry:
    offsets: tuple[int, ...]  # where this shard starts in the global tensor
    shape: tuple[int, ...]
    chunks: tuple[ChunkRef, ...]  # the shard's row-major bytes, in order (the primary copy)
    replicas: tuple[tuple[ChunkRef, ...], ...] = ()  # the same bytes in other ranks' files (other local tiers)

    def copies(self) -> tuple[tuple[ChunkRef, ...], ...]:
        return (self.chunks,) + self.replicas


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    key: str
    dtype: str
    shape: tuple[int, ...]  # global shape
    shards: tuple[ShardEntry, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(dtype_from_name(self.dtype))


@dataclasses.dataclass(frozen=True)
class FileEntry:
    path: str  # a data (pack) file, relative to the tier root
    rank: int  # the rank that wrote it
    tier: str  # the id of that rank's local tier (its TIER file): where the file lives besides the remote tier
    nbytes: int  # its size
    primary_bytes: int  # the prefix holding every primary copy in it: what the remote tier needs


@dataclasses.dataclass(frozen=True)
class Manifest:
    step: int
    trees: tuple[dict[str, Any], ...]  # distinct per-rank trees (one when every rank saved the same values)
    tensors: tuple[TensorEntry, ...]
    world_size: int = 1
    rank_trees: tuple[int, ...] = (0,)  # rank -> index into trees
    files: tuple[FileEntry, ...] = ()
    format_version: int = FORMAT_VERSION
    metrics: Metrics = dataclasses.field(default_factory=dict)  # rank 0's save(..., metrics=...); {}: none (not written)

    @classmethod
    def single(cls, step: int, tree: dict[str, Any], tensors: tuple[TensorEntry, ...], tier: str = "") -> "Manifest":
        """A one-rank manifest; the file table is derived from the chunk references."""
        ends: dict[str, int] = {}
        for t in tensors:
            for s in t.shards:
                for c in s.chunks:
                    ends[c.file] = max(ends.get(c.file, 0), c.offset + c.length)
        files = tuple(FileEntry(f, 0, tier, n, n) for f, n in sorted(ends.items()))
        return cls(step=step, trees=(tree,), tensors=tuple(tensors), files=files)

    @property
    def tree(self) -> dict[str, Any]:
        """Rank 0's tree (the only one for a one-rank checkpoint)."""
        return self.trees[self.rank_trees[0]]

    def tree_of(self, rank: int) -> dict[str, Any]:
        return self.trees[self.rank_trees[rank]]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def data_files(self) -> set[str]:
        return {c.file for t in self.tensors for s in t.shards for copy in s.copies() for c in copy}


@dataclasses.dataclass(frozen=True)
class CommittedStep:
    """A committed step as a saving rank keeps it: its number, the sha256 of the manifest bytes its
    COMMIT names, and the manifest's world size and file table. The next incremental save, the
    upload and the peer copies need no more (only a reader needs the tensors), so a rank that does
    not write the manifest to a tier gets this small value instead of decoding the whole job's
    manifest after every save: its own account (by_rank), with only the files it wrote."""

    step: int
    digest: str  # "sha256:<hex>" of the manifest bytes
    world_size: int
    files: tuple[FileEntry, ...]  # the manifest's file table; in a rank's own account (by_rank), the files that rank wrote

    @classmethod
    def of(cls, manifest: Manifest, digest: str) -> "CommittedStep":
        return cls(manifest.step, digest, manifest.world_size, manifest.files)

    def by_rank(self) -> list["CommittedStep"]:
        """Each rank's own account of the step: the file table cut to the files it wrote, which is
        all a rank that commits on no tier reads of it (its next incremental base, its upload). One
        whole table per rank would cross the store N times over: O(N^2) per save."""
        files: list[list[FileEntry]] = [[] for _ in range(self.world_size)]
        for f in self.files:
            files[f.rank].append(f)
        return [dataclasses.replace(self, files=tuple(mine)) for mine in files]


@dataclasses.dataclass(frozen=True)
class CommitMarker:
    step: int
    manifest: str  # relative path of the manifest file
    manifest_digest: str  # "sha256:<hex>" of the manifest bytes
    format_version: int = FORMAT_VERSION
    metrics: Metrics = dataclasses.field(default_factory=dict, hash=False)  # the manifest's, for listing without reading it


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


def chunk_digest(data: memoryview | bytes) -> str:
    """The digest every chunk reference carries (xxh3-128 releases the GIL while it runs)."""
    return f"{CHUNK_DIGEST}:{xxhash.xxh3_128(data).hexdigest()}"


class ChunkHasher:
    """chunk_digest of bytes fed in pieces (a reader that must not hold a whole chunk in memory)."""

    def __init__(self) -> None:
        self._h = xxhash.xxh3_128()

    def update(self, data: memoryview | bytes) -> None:
        self._h.update(data)

    def digest(self) -> str:
        return f"{CHUNK_DIGEST}:{self._h.hexdigest()}"


def manifest_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _encode_chunks(chunks: tuple[ChunkRef, ...]) -> list[list[Any]]:
    return [[c.file, c.offset, c.length, c.digest] for c in chunks]


def _encode_shard(s: ShardEntry) -> dict[str, Any]:
    out: dict[str, Any] = {"offsets": list(s.offsets), "shape": list(s.shape), "chunks": _encode_chunks(s.chunks)}
    if s.replicas:
        out["replicas"] = [_encode_chunks(r) for r in s.replicas]
    return out


def encode_files(files: tuple[FileEntry, ...]) -> list[list[Any]]:
    """A file table as the manifest (and every message that carries one) writes it."""
    return [[f.path, f.rank, f.tier, f.nbytes, f.primary_bytes] for f in files]


def encode_manifest(m: Manifest) -> bytes:
    """canonical_json of the manifest. The tensor list, which grows with ranks x tensors, is encoded
    tensor by tensor with handoff() between them, not in one C call that holds the GIL throughout
    (about 0.3 s at 256 ranks x 256 DTensors); the bytes are the same (JSON without indentation
    encodes a list element alike wherever it stands)."""
    if m.format_version != FORMAT_VERSION:
        raise ValueError(f"this library writes manifest version {FORMAT_VERSION}, not {m.format_version}")
    fields: dict[str, Any] = {
        **({"metrics": dict(m.metrics)} if m.metrics else {}),
        "format_version": m.format_version,
        "step": m.step,
        "world_size": m.world_size,
        "chunk_digest": CHUNK_DIGEST,
        "files": encode_files(m.files),
        "trees": list(m.trees),
        "rank_trees": list(m.rank_trees),
    }
    out = []
    for name in sorted([*fields, "tensors"]):
        value = _encode_tensors(m.tensors) if name == "tensors" else canonical_json(fields[name])
        out.append(canonical_json(name) + b":" + value)
    return b"{" + b",".join(out) + b"}"


def _encode_tensors(tensors: tuple[TensorEntry, ...]) -> bytes:
    pieces = []
    for t in tensors:
        handoff()
        pieces.append(canonical_json({"key": t.key, "dtype": t.dtype, "shape": list(t.shape), "shards": [_encode_shard(s) for s in t.shards]}))
    return b"[" + b",".join(pieces) + b"]"


def encode_committed_step(c: CommittedStep) -> bytes:
    """What rank 0 tells the other ranks of a step it committed (decode.decode_committed_step reads it)."""
    return canonical_json({"format_version": FORMAT_VERSION, "step": c.step, "manifest_digest": c.digest, "world_size": c.world_size,
                           "files": encode_files(c.files)})


def encode_commit(c: CommitMarker) -> bytes:
    return canonical_json(
        {"format_version": c.format_version, "step": c.step, "manifest": c.manifest, "manifest_digest": c.manifest_digest,
         **({"metrics": dict(c.metrics)} if c.metrics else {})}
    )
