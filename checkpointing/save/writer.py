"""One save, start to commit, as run on the background I/O thread.

Stage (copy into the pool; an incremental save skips chunks whose bytes did not change) and digest
each chunk; once the eager chunks are staged, pin the step (tier/pins.py), open the pack, and hand
each changed chunk to the write-behind thread as soon as it is staged (pack_writer.py) -> tell
local-tier peers which replicated tensors this rank writes -> write what is left (unchanged chunks
not taken from the base, what no peer wrote) -> fsync ->
report (a RankPart) for the coordinator to merge and commit, with what the write produced (a
WriteResult, save/job.py). The writer sets the job's staging progress and its pin; it never sets
its outcome otherwise. The training thread waits only for the chunks it must (eager ones inside
save(), the rest at the guard before optimizer.step()).
"""

from __future__ import annotations

import time

from checkpointing.dist.types import Exchange, Written
from checkpointing.tier import pins
from checkpointing.format import naming
from checkpointing.plan.assign import OTHER, PRIMARY, TIER
from checkpointing.format.dtypes import dtype_name
from checkpointing.format.manifest import ChunkRef
from checkpointing.format.rank_reports import PartLeaf, RankPart, leaf_digest
from checkpointing.plan.reuse import PlaceKey, ReuseBase, shard_place
from checkpointing.save.job import SaveInputs, SaveJob, WriteResult
from checkpointing.save.pack_writer import PackWriter
from checkpointing.save.staging import StagingPool
from checkpointing.save.yielding import CpuYield
from checkpointing.storage import LocalStorage


def run_save(job: SaveJob, pool: StagingPool, storage: LocalStorage, *, write_block: int, rank: int,
             exchange: Exchange, cpu: CpuYield | None = None) -> tuple[RankPart, WriteResult]:
    """Stage and write this rank's part of `job`; returns its report and what the write produced.
    Removes the partial pack on failure. Once every chunk is staged, the threads doing the rest
    yield the CPU to the training loop (`cpu`, save/yielding.py) until something waits for the save.

    Before the pack file exists the rank pins the step (tier/pins.py): a concurrent `gc` then leaves the
    step's directory and every file the save takes chunks from alone.
    """
    inputs = job.inputs
    plan, base = inputs.plan, inputs.base
    pack_path = naming.pack_name(inputs.step, rank, inputs.token)
    # on this thread, so a first (or grown) allocation overlaps the training step; a save with no
    # eager chunk lets save() return first (the guard before optimizer.step() waits for the copy)
    if plan.eager_placements == 0:
        job.staging.eager_staged.set()
    pool.ensure(plan.pool_bytes, pinned=inputs.start_event is not None)  # save() records it for CUDA state
    keys = placement_keys(inputs)
    match = base.against(plan, pool.allocations, keys) if base is not None else None
    pack = PackWriter(inputs, job.staging, pool, write_block, match, cpu=cpu)
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


def _stage(job: SaveJob, pack: PackWriter, storage: LocalStorage, pack_path: str, rank: int) -> None:
    """Pin the step, stage and digest every chunk, and open the pack file: before staging with a
    ring (it writes as it stages); otherwise once the eager chunks are staged, so that the chunks
    this rank surely writes go to the file while the later ones are still being copied. The digests
    run yielding (PackWriter.stage lowers the threads once every chunk is staged)."""
    inputs, outcome = job.inputs, job.outcome
    base = inputs.base
    if inputs.plan.ring:
        outcome.pin = pins.write_pin(storage, inputs.step, rank, inputs.token, [])
        pack.open(storage.open_stream(pack_path, spare=True))
        pack.stage()
        pack.digest_upto(inputs.plan.pack_bytes)
        return

    def opened() -> None:
        outcome.pin = pins.write_pin(storage, inputs.step, rank, inputs.token, sorted(base.files) if base else [])
        if base is not None and not (pins.still_committed(storage, base.step, base.manifest_digest) and _present(storage, base)):
            pack.borrowable = False  # the step was deleted meanwhile, or lost a file: its chunks may be gone
        pack.open(storage.open_stream(pack_path, spare=True), behind=True)  # over a retired pack file if one is kept

    pack.stage(opened)
    pack.digest_upto(inputs.plan.pack_bytes)


def _write(job: SaveJob, pack: PackWriter, exchange: Exchange, by_leaf: list[list[int]], digests: list[str]) -> list[bool]:
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


def _part(inputs: SaveInputs, rank: int, pack_path: str, pack: PackWriter, refs: list[ChunkRef | None],
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

