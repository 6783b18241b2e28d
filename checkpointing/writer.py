"""One save, start to commit, as run on the background I/O thread.

Stage (copy into the pool) -> digest each chunk -> stream the pool to the pack file in large
aligned writes -> fsync -> manifest -> COMMIT. The training thread waits only for the chunks it
must (eager ones inside save(), the rest at the guard before optimizer.step()).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

from . import catalog, layout
from .dtypes import dtype_name
from .manifest import ChunkRef, Manifest, ShardEntry, TensorEntry, chunk_digest
from .plan import PackPlan
from .staging import Copier, StagingPool
from .storage import LocalStorage
from .tree import FlatState


@dataclasses.dataclass(eq=False)
class SaveJob:
    step: int
    flat: FlatState
    plan: PackPlan
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

    @property
    def stall_s(self) -> float:
        return self.call_s + self.guard_wait_s

    def release_waiters(self) -> None:
        self.eager_staged.set()
        self.staged.set()


def run_save(job: SaveJob, pool: StagingPool, storage: LocalStorage, *, write_block: int) -> None:
    """Stage, write and commit `job`. Raises on failure after removing the partial pack."""
    plan = job.plan
    placements = plan.placements
    ring = plan.pool_bytes
    pack_path = layout.pack_name(job.step, 0, job.token)
    storage.makedirs(layout.step_dir(job.step))
    stream = storage.open_stream(pack_path)
    try:
        # on this thread, so a first (or grown) allocation overlaps the training step
        pool.ensure(plan.pool_bytes, pinned=job.start_event is not None)  # save() records it for CUDA state
        copier = Copier(pool, [leaf.tensor for leaf in job.flat.leaves], job.start_event)
        align = stream.alignment
        digests: list[str] = [""] * len(placements)
        state = {"written": 0, "digested": 0}

        def flush(upto: int, final: bool = False) -> None:
            i = state["digested"]
            while i < len(placements) and placements[i].pack_offset + placements[i].length <= upto:
                p = placements[i]
                copier.ready(i)
                start = p.pack_offset % ring
                digests[i] = chunk_digest(pool.view[start : start + p.length])
                i += 1
            state["digested"] = i
            end = upto if final else upto // align * align
            written = state["written"]
            while written < end:  # aligned blocks; only the final one may be short
                start = written % ring
                n = min(end - written, ring - start, write_block)
                stream.write(pool.view[start : start + n])
                written += n
            state["written"] = written

        if plan.eager_placements == 0:
            job.eager_staged.set()
        for i, p in enumerate(placements):
            while p.pack_offset + p.length - state["written"] > ring:
                before = state["written"]
                flush(p.pack_offset)  # ring full: write out what is staged before reusing it
                if state["written"] == before:
                    raise RuntimeError(f"staging ring of {ring} bytes cannot hold chunk {p} (plan invariant broken)")
            copier.copy(i, p.leaf, p.src_offset, p.pack_offset % ring, p.length)
            if i + 1 == plan.eager_placements:
                job.eager_event = copier.last_event()
                job.eager_staged.set()
        job.staged_event = copier.last_event()
        job.t_staged = time.perf_counter()
        job.staged.set()
        flush(plan.pack_bytes, final=True)
        stream.close()
    except BaseException:
        job.release_waiters()
        stream.abort()
        raise
    job.bytes_written = plan.pack_bytes
    job.t_written = time.perf_counter()
    catalog.commit(storage, build_manifest(job, pack_path, digests), job.token)
    job.t_committed = time.perf_counter()


def build_manifest(job: SaveJob, pack_path: str, digests: list[str]) -> Manifest:
    chunks: list[list[ChunkRef]] = [[] for _ in job.flat.leaves]
    for p, d in sorted(zip(job.plan.placements, digests), key=lambda pd: (pd[0].leaf, pd[0].src_offset)):
        chunks[p.leaf].append(ChunkRef(pack_path, p.pack_offset, p.length, d))
    tensors = []
    for leaf, refs in zip(job.flat.leaves, chunks):
        shape = tuple(leaf.tensor.shape)
        tensors.append(
            TensorEntry(leaf.key, dtype_name(leaf.tensor.dtype), shape, (ShardEntry((0,) * len(shape), shape, tuple(refs)),))
        )
    return Manifest(step=job.step, tree=job.flat.tree, tensors=tuple(tensors))
