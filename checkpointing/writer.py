"""One save, start to commit, as run on the background I/O thread.

Stage (copy into the pool) -> digest each chunk -> tell local-tier peers which replicated tensors
this rank writes -> stream the pool to the pack file in large aligned writes -> write what no peer
wrote -> fsync -> report (a RankPart) for the coordinator to merge and commit. The training thread
waits only for the chunks it must (eager ones inside save(), the rest at the guard before
optimizer.step()).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Protocol

from . import layout
from .assign import OTHER, PRIMARY, TIER
from .dtypes import dtype_name
from .manifest import chunk_digest
from .merge import PartLeaf, RankPart, leaf_digest
from .plan import PackPlan
from .staging import Copier, StagingPool
from .storage import LocalStorage
from .tree import FlatState


@dataclasses.dataclass(eq=False)
class SaveJob:
    step: int
    flat: FlatState
    plan: PackPlan
    regions: list[int]  # per leaf: assign.UNIQUE / PRIMARY / TIER / OTHER
    t_call: float  # perf_counter when save() was entered
    wall_time: float
    wait_prev_s: float
    start_event: Any = None  # CUDA: compute-stream event recorded in save()
    token: str = dataclasses.field(default_factory=layout.new_token)
    eager_staged: threading.Event = dataclasses.field(default_factory=threading.Event)
    staged: threading.Event = dataclasses.field(default_factory=threading.Event)
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    eager_event: Any = None  # CUDA: the eager copies' completion, for the compute stream to wait on
    staged_event: Any = None  # CUDA: every copy's completion
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)  # guard accounting vs finish
    stats: Any = None  # SaveStats once finished
    error: BaseException | None = None
    error_reported: bool = False
    call_s: float = 0.0  # time inside save() after wait_prev
    guard_wait_s: float = 0.0
    t_staged: float = 0.0
    t_written: float = 0.0
    t_committed: float = 0.0
    bytes_written: int = 0
    seq: int = 0  # this save's number among the manager's saves: the same on every rank
    exchanged: bool = False  # this rank told its peers what it writes
    manifest: Any = None  # the committed Manifest

    @property
    def stall_s(self) -> float:
        return self.call_s + self.guard_wait_s

    def release_waiters(self) -> None:
        self.eager_staged.set()
        self.staged.set()


class Exchange(Protocol):
    """How a rank learns which replicated tensors its local-tier peers wrote (coordinator.py)."""

    def share_written(self, job: SaveJob, written: list[tuple[str, tuple[int, ...] | None, str]]) -> None: ...

    def peer_written(self, job: SaveJob) -> set[tuple[str, tuple[int, ...] | None, str]]: ...


def run_save(job: SaveJob, pool: StagingPool, storage: LocalStorage, *, write_block: int, rank: int, exchange: Exchange) -> RankPart:
    """Stage and write this rank's part of `job`; returns its report. Removes the partial pack on failure."""
    plan = job.plan
    pack_path = layout.pack_name(job.step, rank, job.token)
    storage.makedirs(layout.step_dir(job.step))
    stream = storage.open_stream(pack_path)
    try:
        # on this thread, so a first (or grown) allocation overlaps the training step
        pool.ensure(plan.pool_bytes, pinned=job.start_event is not None)  # save() records it for CUDA state
        pack = _PackWriter(job, pool, stream, write_block)
        pack.stage()
        pack.digest_upto(plan.pack_bytes)
        leaves = job.flat.leaves
        by_leaf = pack.chunks_by_leaf()
        digests = [leaf_digest(dtype_name(leaf.tensor.dtype), tuple(leaf.tensor.shape), [c[2] for c in by_leaf[i]]) for i, leaf in enumerate(leaves)]
        idents = [(leaf.key, leaf.layout.offsets if leaf.layout else None, digests[i]) for i, leaf in enumerate(leaves)]
        exchange.share_written(job, [idents[i] for i in range(len(leaves)) if job.regions[i] in (PRIMARY, TIER)])
        pack.write_upto(plan.region_ends[TIER] if len(plan.region_ends) > TIER else plan.pack_bytes)
        written = [job.regions[i] != OTHER or not by_leaf[i] for i in range(len(leaves))]
        end = pack.written_through
        if not all(written):
            peers = exchange.peer_written(job)
            for i in range(len(leaves)):
                if not written[i] and idents[i] not in peers:
                    written[i] = True
                    end = max(end, max(o + n for o, n, _ in by_leaf[i]))
        pack.write_upto(end, final=True)
        stream.close()
    except BaseException:
        job.release_waiters()
        stream.abort()
        raise
    job.bytes_written = end
    job.t_written = time.perf_counter()
    part_leaves = tuple(
        PartLeaf(
            leaf.key, dtype_name(leaf.tensor.dtype), tuple(leaf.tensor.shape),
            leaf.layout.global_shape if leaf.layout else None, leaf.layout.offsets if leaf.layout else None,
            digests[i], job.regions[i], tuple(by_leaf[i]) if written[i] else None,
        )
        for i, leaf in enumerate(leaves)
    )
    return RankPart(rank, pack_path, end, job.flat.tree, part_leaves)


class _PackWriter:
    """Copies a plan's chunks into the pool, digests them, and streams a prefix of the pack out.

    The pack file is the pool's image. With a ring (a staging budget) staging must write out what
    it staged before reusing room; without one, staging finishes first and the writer then writes
    as much of the pack as this rank owes.
    """

    def __init__(self, job: SaveJob, pool: StagingPool, stream: Any, write_block: int) -> None:
        self.job = job
        self.plan = job.plan
        self.pool = pool
        self.stream = stream
        self.write_block = write_block
        self.copier = Copier(pool, [leaf.tensor for leaf in job.flat.leaves], job.start_event)
        self.digests = [""] * len(self.plan.placements)
        self.digested = 0  # placements [0, digested) have digests
        self.written = 0  # pack bytes handed to the stream
        self.written_through = 0  # pack offset up to which this rank's bytes are (or will be, at final) written

    def stage(self) -> None:
        job, plan, ring = self.job, self.plan, self.plan.pool_bytes
        if plan.eager_placements == 0:
            job.eager_staged.set()
        for n, i in enumerate(plan.stage_order):
            p = plan.placements[i]
            while p.pack_offset + p.length - self.written > ring:  # only with a ring: stage order is pack order
                before = self.written
                self.digest_upto(p.pack_offset)
                self.write_upto(p.pack_offset)
                if self.written == before:
                    raise RuntimeError(f"staging ring of {ring} bytes cannot hold chunk {p} (plan invariant broken)")
            self.copier.copy(i, p.leaf, p.src_offset, p.pack_offset % ring, p.length)
            if n + 1 == plan.eager_placements:
                job.eager_event = self.copier.last_event()
                job.eager_staged.set()
        job.staged_event = self.copier.last_event()
        job.t_staged = time.perf_counter()
        job.staged.set()

    def digest_upto(self, upto: int) -> None:
        placements, ring = self.plan.placements, self.plan.pool_bytes
        i = self.digested
        while i < len(placements) and placements[i].pack_offset + placements[i].length <= upto:
            p = placements[i]
            self.copier.ready(i)
            start = p.pack_offset % ring
            self.digests[i] = chunk_digest(self.pool.view[start : start + p.length])
            i += 1
        self.digested = i

    def write_upto(self, upto: int, final: bool = False) -> None:
        """Hand pack bytes [written, upto) to the stream: whole aligned blocks, a short tail only when final."""
        ring = self.plan.pool_bytes
        self.written_through = max(self.written_through, upto)
        end = upto if final else upto // self.stream.alignment * self.stream.alignment
        while self.written < end:
            start = self.written % ring
            n = min(end - self.written, ring - start, self.write_block)
            self.stream.write(self.pool.view[start : start + n])
            self.written += n

    def chunks_by_leaf(self) -> list[list[tuple[int, int, str]]]:
        """(pack offset, length, digest) of each leaf's chunks, in the leaf's byte order."""
        out: list[list[tuple[int, int, str]]] = [[] for _ in self.job.flat.leaves]
        for p, d in sorted(zip(self.plan.placements, self.digests), key=lambda pd: (pd[0].leaf, pd[0].src_offset)):
            out[p.leaf].append((p.pack_offset, p.length, d))
        return out
