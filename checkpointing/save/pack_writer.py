"""PackWriter: one save's chunks copied into the pool, digested, and written to its pack file (orchestration).

Three ways to the file, by the plan:
- *Pipelined* (no staging budget: the pool holds the whole pack image). Once the eager chunks are
  staged (save() may return then), `opened` pins the step and opens the pack; from then on each
  chunk this rank surely writes, as known when it is copied (its bytes changed, or there is
  nothing to take it from), that may be the step's primary copy (regions UNIQUE and PRIMARY, which
  come first in the pack as in the file: the prefix the remote tier holds) and that was copied
  from CPU memory, is handed to the write-behind thread (behind.py) in batches of page-aligned
  spans of at least `write_block` bytes, while the later chunks are still being copied. The
  chunks are digested after all are staged (the guard before optimizer.step() waits for the
  copies only), while the write-behind thread writes. A chunk copied from a CUDA tensor joins the
  batches when it is digested (its copy is done then, and its digest tells whether it changed), so
  the file is written while the later chunks are digested. What waits for the end (write_chunks, on
  this thread): the last batch, not full (a state smaller than one batch is written as without
  pipelining, byte for byte), the chunks whose bytes did not change or were not compared
  (reuse.choose_borrowed decides per file whether to take them from the base or write them
  again), the local tier's copies of replicated chunks (regions TIER, and OTHER,
  which a local-tier peer may write instead), and a chunk whose page-aligned span would run past
  the pool's end (only the stream's very last write may be short). A page shared by chunks of two
  batches is written with each (at most a page per batch: padding, never referenced).
- *Ring* (a budget smaller than the pack): staging writes out what it staged, front to back, before
  reusing room; the pack is the image itself, with no reuse.
- Without `opened` the pool is staged first and written afterwards (write_chunks), as the ring
  path's callers and tests do.
"""

from __future__ import annotations

import functools
import time
from typing import Callable

from checkpointing.format.manifest import ChunkRef, chunk_digest
from checkpointing.plan.assign import PRIMARY
from checkpointing.plan.pack import round_up, write_spans
from checkpointing.plan.reuse import Match, choose_borrowed
from checkpointing.save.behind import WriteBehind, write_range
from checkpointing.save.job import SaveInputs, Staging
from checkpointing.save.staging import Copier, StagingPool
from checkpointing.save.writewatch import written_pieces
from checkpointing.save.yielding import CpuYield
from checkpointing.storage import StreamWriter


class PackWriter:
    """Copies a plan's chunks into the pool, digests them, and writes the pack file (see the module)."""

    def __init__(self, inputs: SaveInputs, staging: Staging, pool: StagingPool, write_block: int, base: Match | None,
                 *, cpu: CpuYield | None = None) -> None:
        self.inputs = inputs
        self.cpu = cpu  # lowered once every chunk is staged; the write-behind thread follows it (save/yielding.py)
        self.staging = staging  # this object writes its events and t_staged
        self.plan = inputs.plan
        self.pool = pool
        self.base = base
        self.borrowable = base is not None and inputs.base is not None
        self.stream: StreamWriter | None = None
        self.behind: WriteBehind | None = None
        self.write_block = write_block
        self.copier = Copier(pool, [leaf.tensor for leaf in inputs.flat.leaves], inputs.start_event,
                             versions=[(leaf.key, leaf.version, leaf.version_now) for leaf in inputs.flat.leaves],
                             addresses=[leaf.address for leaf in inputs.flat.leaves])
        n = len(self.plan.placements)
        self.digests = [""] * n
        self.same = [False] * n  # the pool already held these bytes (the base's), so they were not copied
        self.offsets: list[int | None] = [None] * n  # where each written chunk is in the file
        self.borrowed: list[int] = []  # placements taken from the base instead of written
        self.bytes_unwritten = 0  # staging skipped these: the kernel saw no write to them since the last save
        self.digested = 0  # placements [0, digested) have digests
        self.written = 0  # ring mode: pack bytes handed to the stream
        self.file_bytes = 0  # bytes in the pack file
        self._pending: list[int] = []  # pipelined: staged chunks for the next span batch
        self._pending_bytes = 0

    def open(self, stream: StreamWriter, *, behind: bool = False) -> None:
        self.stream = stream
        if behind:
            self.behind = WriteBehind(stream, self.pool.view, self.write_block, cpu=self.cpu)

    def close(self) -> None:
        self.finish_behind()
        self.stream.close()

    def finish_behind(self) -> None:
        """Everything handed to the write-behind thread is in the file (or its error raised)."""
        if self.behind is not None:
            behind, self.behind = self.behind, None
            behind.finish()

    def abort(self) -> None:
        if self.behind is not None:
            self.behind.abort()
            self.behind = None
        if self.stream is not None:
            self.stream.abort()

    def stage(self, opened: Callable[[], None] | None = None) -> None:
        """Copy every chunk into the pool; with `opened`, pipelined (see the module)."""
        staging, plan, ring = self.staging, self.plan, self.plan.pool_bytes
        compare = self.base is not None and self.base.exact
        watched = self.inputs.watch_writes and not plan.ring
        eager = plan.eager_placements
        # the scan comes after the eager copies, so that save() does not wait for it (unless all is eager)
        scan_at = 0 if eager == len(plan.stage_order) else eager
        written: list[list[tuple[int, int]] | None] | None = None
        if eager == 0:
            staging.eager_staged.set()
            if opened is not None:
                opened()
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
            self.same[i] = self.copier.copy(i, p.leaf, p.src_offset, p.pack_offset % ring, p.length, compare=compare,
                                            pieces=pieces, returned=n >= eager)
            if self.same[i] and pieces is not None:
                self.bytes_unwritten += p.length - sum(length for _, length in pieces)
            if n + 1 == eager:
                staging.eager_event = self.copier.last_event()
                staging.eager_staged.set()
                if opened is not None:
                    opened()
                    for k in plan.stage_order[:eager]:
                        self._staged(k, compare)
            elif opened is not None and n >= eager:
                self._staged(i, compare)
        self.copier.check_all_unchanged()
        if watched:
            self.pool.watch.completed()
        staging.staged_event = self.copier.last_event()
        staging.t_staged = time.perf_counter()
        staging.staged.set()
        if self.cpu is not None:
            self.cpu.lower()  # nothing waits for what follows (digests, writes, commit): save/yielding.py

    def _staged(self, i: int, compare: bool) -> None:
        """Pipelined: chunk i is in the pool; queue it for the write-behind thread when this rank
        surely writes it, as known at copy time. Left for the end (write_chunks): a chunk of a
        region after PRIMARY (the file keeps the pack's region order), and one the base may provide
        (unchanged, or not compared: then its digest decides). A chunk copied from a CUDA tensor
        (its copy may still be in flight) is queued when it is digested (_digest). No digest here:
        the guard before optimizer.step() waits only for the copies; the chunks are digested once
        all are staged."""
        p = self.plan.placements[i]
        if self.inputs.regions[p.leaf] > PRIMARY or self.copier.sources[p.leaf].is_cuda:
            return
        if self.borrowable and (self.same[i] or not compare):
            return
        self._queue(i)

    def _queue(self, i: int) -> None:
        """Pipelined: add chunk i to the next batch; hand the batch over once it holds write_block bytes."""
        self._pending.append(i)
        self._pending_bytes += self.plan.placements[i].length
        if self._pending_bytes >= self.write_block:
            self._hand_over()

    def _hand_over(self) -> None:
        """Give the pending chunks to the write-behind thread in page-aligned spans, none of them short.
        A chunk whose aligned span would end past the pool stays for the final, synchronous write."""
        assert self.stream is not None and self.behind is not None
        align, placements = self.stream.alignment, self.plan.placements
        limit = len(self.pool.view)
        chosen = sorted((i for i in self._pending if round_up(placements[i].pack_offset + placements[i].length, align) <= limit),
                        key=lambda i: placements[i].pack_offset)
        self._pending, self._pending_bytes = [], 0
        if not chosen:
            return
        spans = write_spans([placements[i] for i in chosen], align=align)
        spans[-1] = (spans[-1][0], round_up(spans[-1][1], align))  # not the stream's last write: whole pages
        self._emit(chosen, spans, self.behind.put)

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
        """Digest the placements that end at or before pack offset `upto` (pack order)."""
        placements = self.plan.placements
        i = self.digested
        while i < len(placements) and placements[i].pack_offset + placements[i].length <= upto:
            self._digest(i)
            i += 1
        self.digested = i

    def _digest(self, i: int) -> None:
        if self.digests[i]:
            return
        p, base = self.plan.placements[i], self.base
        if self.same[i]:
            assert base is not None and base.digests[i] is not None
            self.digests[i] = base.digests[i]  # type: ignore[assignment]
            return
        self.copier.ready(i)
        start = p.pack_offset % self.plan.pool_bytes
        self.digests[i] = chunk_digest(self.pool.view[start : start + p.length])
        # bytes the pool could not compare (CUDA, another plan): the same position's digest
        cuda = self.copier.sources[p.leaf].is_cuda
        self.same[i] = (base is not None and (not base.exact or cuda) and self.digests[i] == base.digests[i])
        if cuda and self.behind is not None and self.inputs.regions[p.leaf] <= PRIMARY and not (self.borrowable and self.same[i]):
            # pipelined: a CUDA chunk is known to be written once its copy is done and digested (its
            # digest differs from the base's, or there is no base): to the file while the next are digested
            self._queue(i)

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
        """Store placements `chosen` that are not in the file yet: take each from the base where its
        bytes are the same and reuse.choose_borrowed allows it, write the others (in pack order,
        page-aligned spans), on this thread, after what the write-behind thread had."""
        self.finish_behind()
        placements = self.plan.placements
        chosen = [i for i in chosen if self.offsets[i] is None]
        if self.base is not None and self.borrowable:
            wanted = [False] * len(placements)
            for i in chosen:
                wanted[i] = True
            assert self.inputs.base is not None
            regions, leaf = self.inputs.regions, [p.leaf for p in placements]
            primary = [regions[leaf[i]] <= PRIMARY for i in range(len(placements))]
            take = choose_borrowed(self.base.refs, self.inputs.base.files, self.same, wanted, primary)
            self.borrowed.extend(i for i in chosen if take[i])
            chosen = [i for i in chosen if not take[i]]
        chosen.sort(key=lambda i: placements[i].pack_offset)
        self._emit(chosen, write_spans([placements[i] for i in chosen], align=self.stream.alignment), self._write_now)

    def _emit(self, chosen: list[int], spans: list[tuple[int, int]], write: Callable[[int, int], None]) -> None:
        """Place `chosen` (in pack order) at the file's end span by span, and have `write` put each span there."""
        placements = self.plan.placements
        k = 0
        for start, end in spans:
            out = self.file_bytes
            while k < len(chosen) and placements[chosen[k]].pack_offset < end:
                self.offsets[chosen[k]] = out + placements[chosen[k]].pack_offset - start
                k += 1
            write(start, end)
            self.file_bytes += end - start

    def _write_now(self, start: int, end: int) -> None:
        write_range(self.stream, self.pool.view, start, end, self.write_block)

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
