"""One save, start to commit, as run on the background I/O thread.

Stage (copy into the pool; an incremental save skips chunks whose bytes did not change) -> digest
each chunk -> pin the step (tier/pins.py) -> tell local-tier peers which replicated tensors this rank
writes -> write the changed chunks in large aligned writes -> write what no peer wrote -> fsync ->
report (a RankPart) for the coordinator to merge and commit, with what the write produced (a
WriteResult, save/job.py). The writer sets the job's staging progress and its pin; it never sets
its outcome otherwise. The training thread waits only for the chunks it must (eager ones inside
save(), the rest at the guard before optimizer.step()).
"""

from __future__ import annotations

import functools
import time

from checkpointing.dist.types import Exchange, Written
from checkpointing.tier import pins
from checkpointing.format import naming
from checkpointing.plan.assign import OTHER, PRIMARY, TIER
from checkpointing.format.dtypes import dtype_name
from checkpointing.format.manifest import ChunkRef, chunk_digest
from checkpointing.format.rank_reports import PartLeaf, RankPart, leaf_digest
from checkpointing.plan.pack import write_spans
from checkpointing.plan.reuse import Match, PlaceKey, ReuseBase, choose_borrowed, shard_place
from checkpointing.save.job import SaveInputs, SaveJob, Staging, WriteResult
from checkpointing.save.staging import Copier, StagingPool
from checkpointing.save.writewatch import written_pieces
from checkpointing.storage import LocalStorage, StreamWriter


def run_save(job: SaveJob, pool: StagingPool, storage: LocalStorage, *, write_block: int, rank: int,
             exchange: Exchange) -> tuple[RankPart, WriteResult]:
    """Stage and write this rank's part of `job`; returns its report and what the write produced.
    Removes the partial pack on failure.

    Before the pack file exists the rank pins the step (tier/pins.py): a concurrent `gc` then leaves the
    step's directory and every file the save takes chunks from alone.
    """
    inputs = job.inputs
    plan, base = inputs.plan, inputs.base
    pack_path = naming.pack_name(inputs.step, rank, inputs.token)
    # on this thread, so a first (or grown) allocation overlaps the training step
    pool.ensure(plan.pool_bytes, pinned=inputs.start_event is not None)  # save() records it for CUDA state
    keys = placement_keys(inputs)
    match = base.against(plan, pool.allocations, keys) if base is not None else None
    pack = _PackWriter(inputs, job.staging, pool, write_block, match)
    try:
        _stage(job, pack, storage, pack_path, rank)
        by_leaf = pack.placements_by_leaf()
        digests = [leaf_digest(dtype_name(leaf.tensor.dtype), tuple(leaf.tensor.shape), [pack.digests[i] for i in by_leaf[n]])
                   for n, leaf in enumerate(inputs.flat.leaves)]
        stored = _write(job, pack, exchange, by_leaf, digests)
        pack.close()
        if pack.file_bytes == 0:  # every chunk was taken from earlier steps (or a peer's): no file
            storage.delete(pack_path)
    except BaseException:
        job.staging.release()
        pack.abort()
        raise
    t_written = time.perf_counter()
    refs = [pack.ref(i, pack_path) for i in range(len(plan.placements))]
    written = WriteResult(
        t_written=t_written, bytes_written=pack.file_bytes, bytes_reused=sum(plan.placements[i].length for i in pack.borrowed),
        bytes_unwritten=pack.bytes_unwritten, chunks_reused=len(pack.borrowed), chunks_total=len(plan.placements),
        digests=pack.digests, refs=refs, keys=keys,
    )
    return _part(inputs, rank, pack_path, pack, refs, by_leaf, digests, stored), written


def _stage(job: SaveJob, pack: _PackWriter, storage: LocalStorage, pack_path: str, rank: int) -> None:
    """Pin the step, stage and digest every chunk, and open the pack file (a ring writes as it stages)."""
    inputs, outcome = job.inputs, job.outcome
    base = inputs.base
    if inputs.plan.ring:
        outcome.pin = pins.write_pin(storage, inputs.step, rank, inputs.token, [])
        pack.open(storage.open_stream(pack_path))
    pack.stage()
    pack.digest_upto(inputs.plan.pack_bytes)
    if not inputs.plan.ring:
        outcome.pin = pins.write_pin(storage, inputs.step, rank, inputs.token, sorted(base.files) if base else [])
        if base is not None and not (pins.still_committed(storage, base.step, base.manifest_digest) and _present(storage, base)):
            pack.borrowable = False  # the step was deleted meanwhile, or lost a file: its chunks may be gone
        pack.open(storage.open_stream(pack_path))


def _write(job: SaveJob, pack: _PackWriter, exchange: Exchange, by_leaf: list[list[int]], digests: list[str]) -> list[bool]:
    """Tell local-tier peers what this rank writes, write it, then what no peer wrote; per leaf: stored here."""
    inputs = job.inputs
    leaves, regions = inputs.flat.leaves, inputs.regions
    idents = [Written(leaf.key, leaf.layout.offsets if leaf.layout else None, digests[i]) for i, leaf in enumerate(leaves)]
    exchange.share_written(inputs.ref, [idents[i] for i in range(len(leaves)) if regions[i] in (PRIMARY, TIER)])
    if inputs.plan.ring:
        pack.write_upto(inputs.plan.pack_bytes, final=True)
        return [True] * len(leaves)
    first = [regions[n] != OTHER or not by_leaf[n] for n in range(len(leaves))]
    pack.write_chunks([i for n in range(len(leaves)) if first[n] for i in by_leaf[n]])
    stored = list(first)
    if not all(first):
        peers = exchange.peer_written(inputs.ref)
        stored = [s or idents[n] not in peers for n, s in enumerate(first)]
    pack.write_chunks([i for n in range(len(leaves)) if stored[n] and not first[n] for i in by_leaf[n]])
    return stored


def _part(inputs: SaveInputs, rank: int, pack_path: str, pack: _PackWriter, refs: list[ChunkRef | None],
          by_leaf: list[list[int]], digests: list[str], stored: list[bool]) -> RankPart:
    """This rank's report for the coordinator to merge."""
    base = inputs.base
    borrowed_files = tuple(sorted({refs[i].file for i in pack.borrowed}))  # type: ignore[union-attr]
    part_leaves = tuple(
        PartLeaf(
            leaf.key, dtype_name(leaf.tensor.dtype), tuple(leaf.tensor.shape),
            leaf.layout.global_shape if leaf.layout else None, leaf.layout.offsets if leaf.layout else None,
            digests[n], inputs.regions[n],
            tuple((r.file, r.offset, r.length, r.digest) for r in (refs[i] for i in by_leaf[n]) if r is not None) if stored[n] else None,
            leaf.layout.mesh_ranks if leaf.layout else (),
        )
        for n, leaf in enumerate(inputs.flat.leaves)
    )
    borrowed = tuple(base.files[f] for f in borrowed_files) if base is not None else ()
    return RankPart(rank, pack_path, pack.file_bytes, inputs.flat.tree, part_leaves, borrowed)


def _present(storage: LocalStorage, base: ReuseBase) -> bool:
    """Every file the base's chunks are in is still there at its size (one stat per file)."""
    try:
        return all(storage.size(path) == entry.nbytes for path, entry in base.files.items())
    except OSError:
        return False


def placement_keys(inputs: SaveInputs) -> list[PlaceKey]:
    """Per placement: (tensor key, where its shard starts (reuse.shard_place), byte offset in the
    shard, length): a chunk's place whatever the plan, as a manifest also tells it
    (reuse.base_after_restore)."""
    leaves = inputs.flat.leaves
    shard = [shard_place(leaf.layout.offsets if leaf.layout else None) for leaf in leaves]
    return [(leaves[p.leaf].key, shard[p.leaf], p.src_offset, p.length) for p in inputs.plan.placements]


class _PackWriter:
    """Copies a plan's chunks into the pool, digests them, and writes the pack file.

    Without a staging budget the pool holds the whole pack image: staging finishes first (comparing
    each chunk with the previous save's bytes when there is a reuse base), then the chunks this rank
    stores are written in page-aligned spans of the pool, and those it takes from the base are not
    written at all. With a ring (a budget) staging must write out what it staged before reusing
    room: the pack is then the image itself, written front to back, with no reuse.
    """

    def __init__(self, inputs: SaveInputs, staging: Staging, pool: StagingPool, write_block: int, base: Match | None) -> None:
        self.inputs = inputs
        self.staging = staging  # this object writes its events and t_staged
        self.plan = inputs.plan
        self.pool = pool
        self.base = base
        self.borrowable = base is not None and inputs.base is not None
        self.stream: StreamWriter | None = None
        self.write_block = write_block
        self.copier = Copier(pool, [leaf.tensor for leaf in inputs.flat.leaves], inputs.start_event)
        n = len(self.plan.placements)
        self.digests = [""] * n
        self.same = [False] * n  # the pool already held these bytes (the base's), so they were not copied
        self.offsets: list[int | None] = [None] * n  # where each written chunk is in the file
        self.borrowed: list[int] = []  # placements taken from the base instead of written
        self.bytes_unwritten = 0  # staging skipped these: the kernel saw no write to them since the last save
        self.digested = 0  # placements [0, digested) have digests
        self.written = 0  # ring mode: pack bytes handed to the stream
        self.file_bytes = 0  # bytes in the pack file

    def open(self, stream: StreamWriter) -> None:
        self.stream = stream

    def close(self) -> None:
        self.stream.close()

    def abort(self) -> None:
        if self.stream is not None:
            self.stream.abort()

    def stage(self) -> None:
        staging, plan, ring = self.staging, self.plan, self.plan.pool_bytes
        compare = self.base is not None and self.base.exact
        watched = self.inputs.watch_writes and not plan.ring
        eager = plan.eager_placements
        # the scan comes after the eager copies, so that save() does not wait for it (unless all is eager)
        scan_at = 0 if eager == len(plan.stage_order) else eager
        written: list[list[tuple[int, int]] | None] | None = None
        if eager == 0:
            staging.eager_staged.set()
        for n, i in enumerate(plan.stage_order):
            if watched and n == scan_at:
                written = self._written(compare, {plan.placements[k].leaf for k in plan.stage_order[:n]})
            p = plan.placements[i]
            while p.pack_offset + p.length - self.written > ring:  # only with a ring: stage order is pack order
                before = self.written
                self.digest_upto(p.pack_offset)
                self.write_upto(p.pack_offset)
                if self.written == before:
                    raise RuntimeError(f"staging ring of {ring} bytes cannot hold chunk {p} (plan invariant broken)")
            pieces = written[i] if written is not None else None  # the chunk's bytes in pages written since the base
            self.same[i] = self.copier.copy(i, p.leaf, p.src_offset, p.pack_offset % ring, p.length, compare=compare, pieces=pieces)
            if self.same[i] and pieces is not None:
                self.bytes_unwritten += p.length - sum(length for _, length in pieces)
            if n + 1 == plan.eager_placements:
                staging.eager_event = self.copier.last_event()
                staging.eager_staged.set()
        if watched:
            self.pool.watch.completed()
        staging.staged_event = self.copier.last_event()
        staging.t_staged = time.perf_counter()
        staging.staged.set()

    def _written(self, compare: bool, staged: set[int]) -> list[list[tuple[int, int]] | None] | None:
        """Scan the sources for writes since the previous save (always, so that the next save can
        use it); per placement, its pieces in written pages (writewatch.written_pieces), only when
        the pool holds the base's image (`compare`). Leaves in `staged` were copied before the scan:
        a write between their copy and the scan would be hidden from the next save, so they are not
        watched (buffers that forward changes, BatchNorm statistics)."""
        sources = [None if n in staged else r for n, r in enumerate(self.copier.watchable)]
        dirty = self.pool.watch.scan(self.plan, self.pool.allocations, sources)
        if not compare:
            return None
        return written_pieces([(p.leaf, p.src_offset, p.length) for p in self.plan.placements], sources, dirty)

    def digest_upto(self, upto: int) -> None:
        placements, ring, base = self.plan.placements, self.plan.pool_bytes, self.base
        i = self.digested
        while i < len(placements) and placements[i].pack_offset + placements[i].length <= upto:
            p = placements[i]
            if self.same[i]:
                assert base is not None and base.digests[i] is not None
                self.digests[i] = base.digests[i]  # type: ignore[assignment]
            else:
                self.copier.ready(i)
                start = p.pack_offset % ring
                self.digests[i] = chunk_digest(self.pool.view[start : start + p.length])
                # bytes the pool could not compare (CUDA, another plan): the same position's digest
                self.same[i] = (base is not None and (not base.exact or self.copier.sources[p.leaf].is_cuda)
                                and self.digests[i] == base.digests[i])
            i += 1
        self.digested = i

    def write_upto(self, upto: int, final: bool = False) -> None:
        """Ring mode: hand pack bytes [written, upto) to the stream: whole aligned blocks, a short tail only when final."""
        ring = self.plan.pool_bytes
        end = upto if final else upto // self.stream.alignment * self.stream.alignment
        while self.written < end:
            start = self.written % ring
            n = min(end - self.written, ring - start, self.write_block)
            self.stream.write(self.pool.view[start : start + n])
            self.written += n
        self.file_bytes = self.written
        if final:
            for i, p in enumerate(self.plan.placements):
                self.offsets[i] = p.pack_offset

    def write_chunks(self, chosen: list[int]) -> None:
        """Store placements `chosen`: take each from the base where its bytes are the same and
        reuse.choose_borrowed allows it, write the others (in pack order, page-aligned spans)."""
        placements = self.plan.placements
        if self.base is not None and self.borrowable:
            wanted = [False] * len(placements)
            for i in chosen:
                wanted[i] = True
            assert self.inputs.base is not None
            take = choose_borrowed(self.base.refs, self.inputs.base.files, self.same, wanted)
            self.borrowed.extend(i for i in chosen if take[i])
            chosen = [i for i in chosen if not take[i]]
        chosen.sort(key=lambda i: placements[i].pack_offset)
        k = 0
        for start, end in write_spans([placements[i] for i in chosen], align=self.stream.alignment):
            out = self.file_bytes
            while k < len(chosen) and placements[chosen[k]].pack_offset < end:
                self.offsets[chosen[k]] = out + placements[chosen[k]].pack_offset - start
                k += 1
            pos = start
            while pos < end:
                n = min(end - pos, self.write_block)
                self.stream.write(self.pool.view[pos : pos + n])
                pos += n
            self.file_bytes += end - start

    def ref(self, i: int, pack_path: str) -> ChunkRef | None:
        """Where placement i is stored by this save (None: a peer stores it)."""
        p = self.plan.placements[i]
        if self.offsets[i] is not None:
            return ChunkRef(pack_path, self.offsets[i], p.length, self.digests[i])  # type: ignore[arg-type]
        if i in self._borrowed_set:
            assert self.base is not None
            return self.base.refs[i]
        return None

    @functools.cached_property
    def _borrowed_set(self) -> set[int]:
        return set(self.borrowed)

    def placements_by_leaf(self) -> list[list[int]]:
        """Each leaf's placement indices, in the leaf's byte order."""
        out: list[list[int]] = [[] for _ in self.inputs.flat.leaves]
        for i in sorted(range(len(self.plan.placements)), key=lambda i: (self.plan.placements[i].leaf, self.plan.placements[i].src_offset)):
            out[self.plan.placements[i].leaf].append(i)
        return out
