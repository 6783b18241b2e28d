"""Reading a step's verified bytes into target boxes (layer: restore; I/O).

Each target covers a box of its global tensor (a DTensor its local shard, a plain tensor all of
it). Every saved shard overlapping the box is read from a copy this rank can reach (its local
tier, else a peer copy on its node's disk, else the remote one): whole chunks, each verified against its digest, straight into the
target's memory when the box is exactly one saved shard (the usual same-world case), else through
a buffer of the shard's rows that hold the box (also for a lazy conj/neg view: its raw bytes are
not its values, so it is filled with copy_).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from typing import Mapping

import torch

from checkpointing.format import naming
from checkpointing.format.dtypes import dtype_from_name
from checkpointing.errors import CheckpointCorruptError, CheckpointError
from checkpointing.format.manifest import ChunkRef, Manifest, ShardEntry, TensorEntry, chunk_digest
from checkpointing.state.sharding import intersect, row_span
from checkpointing.state.views import tensor_view
from checkpointing.storage import Storage

log = logging.getLogger("checkpointing")

READ_THREADS = 4


@dataclasses.dataclass(frozen=True)
class ReadBox:
    entry: TensorEntry
    dest: torch.Tensor  # local memory to fill (a DTensor's local shard)
    box_offsets: tuple[int, ...]  # the part of the global tensor `dest` holds
    box_shape: tuple[int, ...]


class Sources:
    """Where this rank reads a step's data files from, in order of preference.

    The local tier holds the files the manifest places on its tier (a missing one there is damage,
    reported as such) when it holds the step at all (`local` is None when it does not: pruned, or a
    replaced node); `replicas` (peer copies on this node's disk: tier id -> a storage with the step
    committed) hold the files the manifest places on those tiers; a remote tier, when it holds the
    step, holds every primary copy. A shard whose copy fails verification is read again from the
    next of those that holds it (see read_box).
    """

    def __init__(self, manifest: Manifest, local: Storage | None, tier: str, remote: Storage | None = None, *, where: str = "",
                 replicas: Mapping[str, Storage] | None = None) -> None:
        self.tier_of = {f.path: f.tier for f in manifest.files}
        self.rank_of = {f.path: f.rank for f in manifest.files}
        self.step_bytes = manifest.nbytes
        self.local = local
        self.tier = tier
        self.remote = remote
        self.replicas = dict(replicas or {})
        self.where = where
        self._lock = threading.Lock()
        self.remote_bytes = 0  # bytes read from the remote tier (restore's log line)
        self.peer_bytes: dict[str, int] = {}  # bytes read from each peer copy, by its location
        self.bytes_read = 0  # bytes of chunks read from any tier (each rank reads only what its targets overlap)
        self.fallbacks: list[str] = []  # local copies that failed verification and were read remotely

    def pick(self, shard: ShardEntry) -> tuple[Storage, tuple[ChunkRef, ...]] | None:
        found = self.candidates(shard)
        return found[0] if found else None

    def candidates(self, shard: ShardEntry) -> list[tuple[Storage, tuple[ChunkRef, ...]]]:
        """Where the shard can be read, in order: the local tier, a peer copy, the remote tier."""
        out: list[tuple[Storage, tuple[ChunkRef, ...]]] = []
        if self.local is not None:
            for copy in shard.copies():
                if not copy or self.tier_of.get(copy[0].file, "") in ("", self.tier):
                    out.append((self.local, copy))
                    break
        for copy in shard.copies() if self.replicas else ():
            replica = self.replicas.get(self.tier_of.get(copy[0].file, "")) if copy else None
            if replica is not None:
                out.append((replica, copy))
                break
        if self.remote is not None:
            out.append((self.remote, shard.chunks))
        return out

    def count(self, storage: Storage, nbytes: int) -> None:
        with self._lock:
            self.bytes_read += nbytes
            if storage is self.remote:
                self.remote_bytes += nbytes
            elif any(storage is r for r in self.replicas.values()):
                self.peer_bytes[storage.url] = self.peer_bytes.get(storage.url, 0) + nbytes

    def summary(self, local_name: str, remote_name: str) -> str:
        """Where the bytes came from, for the restore's log line."""
        peer = sum(self.peer_bytes.values())
        local = self.bytes_read - self.remote_bytes - peer
        parts = [f"{local / 1e6:.1f} MB from {local_name}"] if local or not (self.remote_bytes or peer) else []
        parts.extend(f"{n / 1e6:.1f} MB from the peer copy {url}" for url, n in sorted(self.peer_bytes.items()))
        if self.remote_bytes:
            parts.append(f"{self.remote_bytes / 1e6:.1f} MB from the remote tier {remote_name}")
        return f"{' and '.join(parts)} (the step holds {self.step_bytes / 1e6:.1f} MB)"

    def fell_back(self, note: str) -> None:
        with self._lock:
            self.fallbacks.append(note)


def overlapping(read: ReadBox) -> list[ShardEntry]:
    return [s for s in read.entry.shards if s.chunks and intersect(read.box_offsets, read.box_shape, s.offsets, s.shape)]


def read_box(sources: Sources, step: int, read: ReadBox) -> None:
    """Fill `read.dest` (its box of the global tensor) from every overlapping saved shard."""
    entry = read.entry
    if math.prod(read.box_shape) == 0:
        return
    for shard in overlapping(read):
        found = sources.candidates(shard)
        if not found:
            raise CheckpointError(
                f"step {step}, tensor {entry.key!r}: the shard at {list(shard.offsets)} is in {shard.chunks[0].file}, which "
                f"this rank cannot reach{sources.where}"
            )
        for i, (storage, chunks) in enumerate(found):
            try:
                _read_shard(storage, step, entry, shard, chunks, read, sources)
                break
            except CheckpointCorruptError as exc:
                if i + 1 == len(found):
                    raise
                # this copy is damaged or gone: read the shard from the next that holds it (a peer copy, the remote tier)
                nxt = found[i + 1][0]
                what = f"the remote tier {nxt.url}" if nxt is sources.remote else f"the peer copy {nxt.url}"
                log.warning("checkpointing: %s; reading this shard from %s instead", exc, what)
                sources.fell_back(str(exc))


def _read_shard(storage: Storage, step: int, entry: TensorEntry, shard: ShardEntry, chunks: tuple[ChunkRef, ...], read: ReadBox, sources: Sources) -> None:
    dest = read.dest
    whole = shard.offsets == read.box_offsets and shard.shape == read.box_shape
    if whole and dest.device.type == "cpu" and dest.is_contiguous() and not dest.is_conj() and not dest.is_neg():
        sources.count(storage, sum(c.length for c in chunks))
        _read_chunks(storage, step, entry, chunks, tensor_view(dest), 0)  # straight into the target
        return
    box = intersect(read.box_offsets, read.box_shape, shard.offsets, shard.shape)
    assert box is not None
    sources.count(storage, _copy_box(storage, step, entry, shard, chunks, box, read))


def _copy_box(storage: Storage, step: int, entry: TensorEntry, shard: ShardEntry, chunks: tuple[ChunkRef, ...], box: tuple, read: ReadBox) -> int:
    """Read the whole chunks that hold `box`'s rows of `shard`, verify them, copy the box into dest; the bytes read."""
    dtype = dtype_from_name(entry.dtype)
    size = torch.empty((), dtype=dtype).element_size()
    offsets, shape = box
    r0, r1 = row_span(offsets, shape, shard.offsets, shard.shape)
    row_bytes = math.prod(shard.shape[1:]) * size if shard.shape else size
    lo, hi = r0 * row_bytes, r1 * row_bytes
    starts = [0]
    for c in chunks:
        starts.append(starts[-1] + c.length)
    first = max(i for i in range(len(chunks)) if starts[i] <= lo)
    last = min(i for i in range(1, len(chunks) + 1) if starts[i] >= hi)
    buf = torch.empty(starts[last] - starts[first], dtype=torch.uint8)
    _read_chunks(storage, step, entry, chunks[first:last], tensor_view(buf), 0)
    rows = buf[lo - starts[first] : hi - starts[first]]
    if (lo - starts[first]) % size:
        rows = rows.clone()  # a chunk boundary that is not element-aligned
    if not shard.shape:
        read.dest.copy_(rows.view(dtype).reshape(()))
        return len(buf)
    rows = rows.view(dtype).reshape((r1 - r0,) + tuple(shard.shape[1:]))
    src = rows[(slice(None),) + tuple(slice(o - s, o - s + n) for o, s, n in zip(offsets[1:], shard.offsets[1:], shape[1:]))]
    read.dest[tuple(slice(o - b, o - b + n) for o, b, n in zip(offsets, read.box_offsets, shape))].copy_(src)
    return len(buf)


def _read_chunks(storage: Storage, step: int, entry: TensorEntry, chunks: tuple[ChunkRef, ...], view: memoryview, pos: int) -> None:
    """Read `chunks` (coalescing neighbours in one file) into view[pos:], verifying each digest."""
    i = 0
    while i < len(chunks):
        j = i + 1
        while j < len(chunks) and chunks[j].file == chunks[i].file and chunks[j].offset == chunks[j - 1].offset + chunks[j - 1].length:
            j += 1
        length = sum(c.length for c in chunks[i:j])
        where = f"step {step}, tensor {entry.key!r}, file {storage.url}/{chunks[i].file}"
        try:
            storage.read_into(chunks[i].file, chunks[i].offset, view[pos : pos + length])
        except FileNotFoundError:
            raise CheckpointCorruptError(f"{where}: the data file is missing{naming.borrowed_hint(step, chunks[i].file)}") from None
        except EOFError as exc:
            raise CheckpointCorruptError(f"{where}: truncated ({exc})") from None
        for c in chunks[i:j]:
            got = chunk_digest(view[pos : pos + c.length])
            if got != c.digest:
                raise CheckpointCorruptError(
                    f"{where}: bytes {c.offset}..{c.offset + c.length} are damaged ({got} != {c.digest}); "
                    "use another step (step=N; CLI: --step N), or run `checkpointing verify`"
                )
            pos += c.length
        i = j
