"""Multi-rank benchmark: real processes on gloo (127.0.0.1), ours against DCP async_save.

    python bench/bench_dist.py commit        # commit time and CPU per save at 1, 2, 4, 8 ranks, small sharded state
    python bench/bench_dist.py flatten       # save()'s walk over 8 x --tensors DTensors (one rank): per DTensor
    python bench/bench_dist.py merge         # rank 0's merge of 8 reports of 8 x --tensors DTensors, GC on/off, by heap size
    python bench/bench_dist.py reports --worlds 8,64,256 --tensors 256   # rank 0's commit work (parse, merge) by job size
    python bench/bench_dist.py sharded       # 2 ranks, a sharded state: per-rank stall and time to commit
    python bench/bench_dist.py mesh2d        # 4 ranks, FSDP2 over tensor parallel on a 2x2 (dp, tp) mesh: the same
    python bench/bench_dist.py all --md      # all of them, as markdown for docs/benchmarks.md

Every rank prints its own numbers; the table shows the slowest rank (what the job waits for).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

now = time.perf_counter


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world: int, port: int, fn: str, args: dict, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    result = globals()[fn](rank, world, **args)
    Path(out, f"{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    os._exit(0)


def launch(fn: str, world: int, **args) -> list[dict]:
    out = tempfile.mkdtemp(prefix="bench-dist-")
    ctx = mp.get_context("spawn")
    port = _port()
    procs = [ctx.Process(target=_child, args=(r, world, port, fn, args, out)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(900)
        if p.exitcode != 0:
            raise SystemExit(f"{fn} rank failed with exit code {p.exitcode}")
    results = [json.loads(Path(out, f"{r}.json").read_text()) for r in range(world)]
    shutil.rmtree(out)
    return results


def sharded_state(world: int, total_bytes: int, n_tensors: int) -> tuple[torch.nn.ParameterList, torch.optim.Optimizer]:
    """`n_tensors` parameters sharded on dim 0 over all ranks, with SGD momentum (as much state again)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    rows = max(world, total_bytes // 2 // n_tensors // 4 // 256)
    g = torch.Generator().manual_seed(0)
    params = torch.nn.ParameterList(
        torch.nn.Parameter(distribute_tensor(torch.randn(rows, 256, generator=g), mesh, [Shard(0)])) for _ in range(n_tensors)
    )
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    opt.step()  # momentum buffers exist
    return params, opt


# ----------------------------------------------------------------------------- commit time


def commit_worker(rank: int, world: int, root: str, saves: int, tensors: int) -> dict:
    """Saves of a small sharded state, each waited for: the commit's time, and this process's CPU
    per save (every thread: the save() call and the background work; the state is 16 MiB in all,
    so the part that grows with ranks and tensors is the coordination's)."""
    from checkpointing import CheckpointManager

    params, opt = sharded_state(world, 8 << 20, tensors)
    out = []
    with CheckpointManager(root, keep_local=1, timeout_s=120) as mgr:
        for step in range(saves):
            cpu0 = time.process_time()
            st = mgr.save(step, {"params": params, "optim": opt, "meta": {"step": step}}).wait()
            out.append({"commit_s": st.commit_s, "total_s": st.total_s, "cpu_s": time.process_time() - cpu0})
        manifest = next(Path(root).glob(f"step-{saves - 1:010d}/manifest.*.json")).stat().st_size if rank == 0 else 0
    return {"commit_s": statistics.median(r["commit_s"] for r in out[1:]), "total_s": statistics.median(r["total_s"] for r in out[1:]),
            "cpu_s": statistics.median(r["cpu_s"] for r in out[1:]), "manifest_bytes": manifest}


def bench_commit(root: str, worlds: list[int], saves: int, tensors: int) -> list[dict]:
    rows = []
    for world in worlds:
        d = os.path.join(root, f"commit-{world}")
        res = launch("commit_worker", world, root=d, saves=saves, tensors=tensors)
        rows.append({"world": world, "tensors": tensors, "commit_s": max(r["commit_s"] for r in res), "total_s": max(r["total_s"] for r in res),
                     "cpu_rank0_s": res[0]["cpu_s"], "cpu_others_s": max((r["cpu_s"] for r in res[1:]), default=0.0),
                     "manifest_bytes": res[0]["manifest_bytes"]})
        shutil.rmtree(d, ignore_errors=True)
        r = rows[-1]
        print(f"commit  world={world}: commit {r['commit_s'] * 1e3:.1f} ms, save->committed {r['total_s'] * 1e3:.1f} ms, CPU per save: rank 0 "
              f"{r['cpu_rank0_s'] * 1e3:.1f} ms, other ranks (max) {r['cpu_others_s'] * 1e3:.1f} ms; manifest {r['manifest_bytes'] / 1e3:.0f} kB", flush=True)
    return rows


def flatten_worker(rank: int, world: int, tensors: int, reps: int) -> dict:
    """What save() spends on the training thread walking a state of DTensors (flatten_state: keys,
    local shards, layouts), without copying anything: per call, median of `reps`."""
    from checkpointing.state.tree import flatten_state

    params, opt = sharded_state(world, 8 << 20, tensors)
    state = {"params": params, "optim": opt}
    for _ in range(3):
        leaves = len(flatten_state(state).leaves)
    times = []
    for _ in range(reps):
        t0 = now()
        flatten_state(state)
        times.append(now() - t0)
    return {"leaves": leaves, "flatten_s": statistics.median(times)}


def bench_flatten(tensors: int, reps: int) -> dict:
    r = launch("flatten_worker", 1, tensors=tensors, reps=reps)[0]
    print(f"flatten {r['leaves']} DTensors: {r['flatten_s'] * 1e3:.1f} ms per save() ({r['flatten_s'] / r['leaves'] * 1e6:.0f} us each)", flush=True)
    return r


def synthetic_parts(world: int, tensors: int) -> list:
    """The reports `world` ranks send rank 0 for `tensors` DTensors each sharded on dim 0 over all of
    them (one 8 KiB chunk per shard), as format.rank_reports encodes them."""
    from checkpointing.format.manifest import chunk_digest
    from checkpointing.format.rank_reports import PartLeaf, RankPart, encode_part, leaf_digest

    parts = []
    mesh = tuple(range(world))  # one tuple per layout, as state/sharding's layout cache gives every leaf of it
    for r in range(world):
        pack = f"step-0000000001/r{r:05d}.0123456789ab.pack"
        leaves = []
        for t in range(tensors):
            digest = chunk_digest(f"{r}/{t}".encode())
            leaves.append(PartLeaf(f"params/{t}", "float32", (8, 256), (8 * world, 256), (8 * r, 0),
                                   leaf_digest("float32", (8, 256), [digest]), 0, ((pack, t * 8192, 8192, digest),), mesh))
        tree = {"dict": [[f"params/{t}", {"tensor": t}] for t in range(tensors)]}
        parts.append(encode_part(RankPart(r, pack, tensors * 8192, tree, tuple(leaves))))
    return parts


def bench_merge(world: int, tensors: int, heaps: list[int], reps: int = 5) -> list[dict]:
    """Rank 0's part of a commit in one process (parse every report, merge, encode, decode), with
    Python's cyclic collector on and off, while the process holds N more long-lived objects (a
    training process holds a few hundred thousand: torch, the model, a framework)."""
    import gc
    import json

    from checkpointing.format.rank_reports import merge_parts, part_from

    blobs = synthetic_parts(world, tensors)

    def once() -> None:
        merge_parts(1, [part_from(json.loads(b)) for b in blobs], ("t",) * world)

    rows = []
    for n in heaps:
        heap = [[i] for i in range(n)]
        gc.collect()
        base = len(gc.get_objects())
        times = {}
        for label, enabled in (("on", True), ("off", False)):
            (gc.enable if enabled else gc.disable)()
            runs = []
            for _ in range(reps):
                t0 = now()
                once()
                runs.append(now() - t0)
            times[label] = statistics.median(runs)
        gc.enable()
        rows.append({"objects": base, "gc_on_s": times["on"], "gc_off_s": times["off"]})
        print(f"merge  {world} reports x {tensors} DTensors, {base:,} objects in the process: collector on {times['on'] * 1e3:.1f} ms, "
              f"off {times['off'] * 1e3:.1f} ms", flush=True)
        del heap
    return rows


def bench_reports(worlds: list[int], tensors: int, reps: int = 3) -> list[dict]:
    """How rank 0's commit work grows with the job: `tensors` DTensors, each sharded on dim 0 over
    every rank, at each world size. Per world: one rank's report (its bytes, the CPU to encode it on
    that rank), then rank 0's CPU to parse all of them and to merge (merge, encode, decode the
    manifest), with the cyclic collector off (as dist/gcpause runs it). Medians of `reps`."""
    import gc
    import json

    from checkpointing.format.rank_reports import encode_part, merge_parts, part_from

    rows = []
    for world in worlds:
        blobs = synthetic_parts(world, tensors)
        gc.collect()
        gc.disable()
        try:
            parts = [part_from(json.loads(b)) for b in blobs]
            enc, parse, merge = [], [], []
            for _ in range(reps):
                t0 = time.thread_time()
                encode_part(parts[-1])
                t1 = time.thread_time()
                parsed = [part_from(json.loads(b)) for b in blobs]
                t2 = time.thread_time()
                _, data, _ = merge_parts(1, parsed, ("t",) * world)
                t3 = time.thread_time()
                enc.append(t1 - t0)
                parse.append(t2 - t1)
                merge.append(t3 - t2)
                del parsed
        finally:
            gc.enable()
        row = {"world": world, "tensors": tensors, "shards": world * tensors, "report_bytes": len(blobs[-1]), "reports_bytes": sum(map(len, blobs)),
               "manifest_bytes": len(data), "encode_s": statistics.median(enc), "parse_s": statistics.median(parse), "merge_s": statistics.median(merge)}
        row.update(_restore_decode(data, reps))
        row.update(_store_copy(data))
        row.update(_accounts(data))
        rows.append(row)
        print(f"reports {world:4d} ranks x {tensors} DTensors: a report {row['report_bytes'] / 1e3:.0f} kB (encode {row['encode_s'] * 1e3:.1f} ms), "
              f"rank 0 parses {row['reports_bytes'] / 1e6:.1f} MB in {row['parse_s'] * 1e3:.0f} ms, merges in {row['merge_s'] * 1e3:.0f} ms "
              f"(manifest {row['manifest_bytes'] / 1e6:.1f} MB; each other tier's leader fetches {row['store_manifest_bytes'] / 1e6:.2f} MB, "
              f"compressed in {row['compress_s'] * 1e3:.0f} ms, inflated in {row['decompress_s'] * 1e3:.0f} ms): {(row['parse_s'] + row['merge_s']) / row['shards'] * 1e6:.1f} us per shard; "
              f"a restore decodes it in {row['decode_s'] * 1e3:.0f} ms (collector on throughout: {row['decode_gc_on_s'] * 1e3:.0f} ms); "
              f"a rank's account of the step: the whole file table {row['account_whole_bytes'] / 1e3:.1f} kB (decoded in "
              f"{row['account_whole_s'] * 1e3:.2f} ms), its own files {row['account_own_bytes']} B ({row['account_own_s'] * 1e3:.2f} ms)", flush=True)
        del blobs, parts
    return rows


def _store_copy(data: bytes) -> dict:
    """What every other local tier's leader fetches from rank 0's store per save: the manifest,
    zlib level 1 (dist/store_coordinator.py); rank 0's CPU to compress it, a leader's to inflate it."""
    import zlib

    t0 = time.thread_time()
    packed = zlib.compress(data, 1)
    t1 = time.thread_time()
    zlib.decompress(packed)
    t2 = time.thread_time()
    return {"store_manifest_bytes": len(packed), "compress_s": t1 - t0, "decompress_s": t2 - t1}


def _accounts(data: bytes) -> dict:
    """What a rank that commits on no tier reads from the store per save: the step with the whole
    file table (before), or with its own files (CommittedStep.by_rank, where the code has it)."""
    from checkpointing.format.decode import decode_committed_step, decode_manifest
    from checkpointing.format.manifest import CommittedStep, encode_committed_step, manifest_digest

    whole = CommittedStep.of(decode_manifest(data, "bench"), manifest_digest(data))
    own = whole.by_rank()[-1] if hasattr(whole, "by_rank") else whole
    out = {}
    for name, account in (("whole", whole), ("own", own)):
        blob = encode_committed_step(account)
        t0 = time.thread_time()
        for _ in range(10):
            decode_committed_step(blob, "bench")
        out[f"account_{name}_bytes"], out[f"account_{name}_s"] = len(blob), (time.thread_time() - t0) / 10
    return out


def _restore_decode(data: bytes, reps: int) -> dict:
    """decode_manifest as a restore calls it (with the collector paused inside, where the code does
    that), and the decoder's body with the collector on, in a process holding a model (~300 k objects)."""
    import gc

    from checkpointing.format import decode

    model = torch.nn.Transformer(num_encoder_layers=12, num_decoder_layers=12)  # noqa: F841 - held: a training process's heap
    inner = getattr(decode, "_decode_manifest", decode.decode_manifest)
    out = {}
    for name, fn in (("decode_s", decode.decode_manifest), ("decode_gc_on_s", inner)):
        gc.collect()
        runs = []
        for _ in range(reps):
            t0 = time.thread_time()
            fn(data, "bench")
            runs.append(time.thread_time() - t0)
        out[name] = statistics.median(runs)
    return out


# ----------------------------------------------------------------------------- stall and time to commit


def _compute(n: int) -> None:
    a = torch.randn(n, n)
    (a @ a).sum()


def sharded_worker(rank: int, world: int, root: str, mode: str, total_bytes: int, steps: int, every: int, compute: int) -> dict:
    params, opt = sharded_state(world, total_bytes, 32)
    local = sum(p.to_local().numel() * 4 for p in params) * 2
    recs = []
    mgr = stager = prev = pending = None
    if mode == "ours":
        from checkpointing import CheckpointManager

        mgr = CheckpointManager(os.path.join(root, "ours"), keep_local=2, timeout_s=300)
    elif mode == "dcp":
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_non_blocking_copy=False, use_shared_memory=False, use_async_staging=True))
    dist.barrier()
    t_loop = now()
    for i in range(steps):
        _compute(compute)
        if pending is not None:  # DCP: staging must finish before the optimizer mutates the state
            t0 = now()
            pending.result()
            recs[-1]["stall_s"] += now() - t0
            pending = None
        opt.step()
        if i % every == every - 1:
            t0 = now()
            if mode == "ours":
                h = mgr.save(i, {"params": params, "optim": opt})
                recs.append({"handle": h, "stall_s": 0.0})
            elif mode == "dcp":
                import torch.distributed.checkpoint as dcp
                from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

                if prev is not None:
                    prev.result()
                r = dcp.async_save({"params": params.state_dict(), "optim": opt.state_dict()}, checkpoint_id=os.path.join(root, "dcp", f"step-{i}"),
                                   async_checkpointer_type=AsyncCheckpointerType.THREAD, async_stager=stager)
                prev, pending = r.upload_completion, r.staging_completion
                rec = {"stall_s": now() - t0, "t0": t0}
                prev.add_done_callback(lambda _f, rec=rec: rec.setdefault("durable_s", now() - rec["t0"]))
                recs.append(rec)
    if mode == "ours":
        mgr.wait()
        out = [{"stall_s": r["handle"].wait().stall_s + r["handle"].wait().wait_prev_s, "durable_s": r["handle"].wait().total_s} for r in recs]
        mgr.close()
    elif mode == "dcp":
        if pending is not None:
            pending.result()
        prev.result()
        time.sleep(0.05)
        out = [{"stall_s": r["stall_s"], "durable_s": r["durable_s"]} for r in recs]
        stager.close()
    else:
        out = []
    loop_s = now() - t_loop
    return {"loop_s": loop_s, "local_bytes": local, "saves": out}


def bench_sharded(root: str, total_bytes: int, steps: int, every: int, compute: int) -> dict:
    res = {}
    for mode in ("baseline", "ours", "dcp", "ours", "dcp", "baseline"):  # twice each, interleaved: the machine drifts
        d = os.path.join(root, f"sharded-{mode}")
        r = launch("sharded_worker", 2, root=d, mode=mode, total_bytes=total_bytes, steps=steps, every=every, compute=compute)
        shutil.rmtree(d, ignore_errors=True)
        res.setdefault(mode, []).append(r)
        print(f"sharded {mode}: loop {max(x['loop_s'] for x in r):.2f} s", flush=True)
    base = statistics.mean(max(x["loop_s"] for x in r) for r in res["baseline"])
    summary = {"local_bytes": res["ours"][0][0]["local_bytes"], "baseline_loop_s": base}
    for mode in ("ours", "dcp"):
        runs = res[mode]
        saves = len(runs[0][0]["saves"])
        summary[mode] = {
            "loop_overhead_per_save_s": statistics.mean(max(x["loop_s"] for x in r) - base for r in runs) / saves,
            "stall_s": statistics.median(max(x["saves"][k]["stall_s"] for x in r) for r in runs for k in range(saves)),
            "durable_s": statistics.median(max(x["saves"][k]["durable_s"] for x in r) for r in runs for k in range(saves)),
        }
    return summary


# ----------------------------------------------------------------------------- 2-D parallel: FSDP2 over tensor parallel

MESH2D = {"vocab": 16384, "dim": 512, "n_heads": 8, "n_layers": 4, "ffn_hidden": 1536, "batch": 4, "seq": 64}


def _example_2d():
    """examples/train_2d.py as a module: the bench lays out its model exactly as the example does."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_2d", Path(__file__).resolve().parent.parent / "examples" / "train_2d.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def mesh2d_job(world: int, sizes: dict):
    """The example's llama-shaped model at `sizes`, parallelized on a (2, world/2) (dp, tp) mesh: TP then
    fully_shard per block and on the root; its AdamW; and a training step (rows of a seeded global batch per dp rank)."""
    from torch.distributed.device_mesh import init_device_mesh

    ex = _example_2d()
    args = type("Sizes", (ex.Args,), dict(sizes))
    torch.manual_seed(0)
    model = ex.Transformer(args)
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    ex.apply_tp(model, mesh["tp"])
    ex.apply_fsdp(model, mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    dp_rank, n = mesh["dp"].get_local_rank(), sizes["batch"] // 2

    def step(i: int, before_update=None) -> None:
        g = torch.Generator().manual_seed(i)
        tokens = torch.randint(0, sizes["vocab"], (sizes["batch"], sizes["seq"] + 1), generator=g)[dp_rank * n:(dp_rank + 1) * n]
        loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        if before_update is not None:
            before_update()
        opt.step()
        opt.zero_grad()

    return model, opt, step


def _local_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[int, int]:
    """(bytes this rank holds of parameters + AdamW state, global bytes of the same tensors)."""
    local = glob = 0
    tensors = list(model.parameters()) + [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        data = t.to_local() if hasattr(t, "to_local") else t
        local += data.numel() * data.element_size()
        glob += t.numel() * t.element_size()
    return local, glob


def mesh2d_worker(rank: int, world: int, root: str, mode: str, steps: int, every: int, sizes: dict) -> dict:
    model, opt, train_step = mesh2d_job(world, sizes)
    for i in range(2):  # warm-up: AdamW state exists, the first steps' one-time costs are paid
        train_step(-1 - i)
    local, glob = _local_bytes(model, opt)
    recs: list = []
    mgr = stager = prev = None
    pending: list = []
    if mode == "ours":
        from checkpointing import CheckpointManager

        mgr = CheckpointManager(os.path.join(root, "ours"), keep_local=2, timeout_s=300)
    elif mode == "dcp":
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_non_blocking_copy=False, use_shared_memory=False, use_async_staging=True))
        dcp_pg = dist.new_group(backend="gloo")  # DCP's background collectives get their own group (as torchtitan does)

    def staged() -> None:  # DCP: staging must finish before the optimizer mutates the state
        if pending:
            t0 = now()
            pending.pop().result()
            recs[-1]["stall_s"] += now() - t0

    dist.barrier()
    t_loop = now()
    for i in range(steps):
        train_step(i, staged)
        if i % every == every - 1 and i < steps - every:  # the last save has `every` steps to finish in
            t0 = now()
            if mode == "ours":
                h = mgr.save(i, {"model": model, "optim": opt})
                recs.append({"handle": h, "call_s": now() - t0})
            elif mode == "dcp":
                import torch.distributed.checkpoint as dcp
                from torch.distributed.checkpoint.state_dict import get_state_dict
                from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

                if prev is not None:
                    prev.result()
                t1 = now()
                msd, osd = get_state_dict(model, opt)
                t2 = now()
                r = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(root, "dcp", f"step-{i}"), process_group=dcp_pg,
                                   async_checkpointer_type=AsyncCheckpointerType.THREAD, async_stager=stager)
                prev = r.upload_completion
                pending.append(r.staging_completion)
                rec = {"stall_s": now() - t0, "t0": t0, "wait_prev_s": t1 - t0, "state_dict_s": t2 - t1, "call_s": now() - t1}
                prev.add_done_callback(lambda _f, rec=rec: rec.setdefault("durable_s", now() - rec["t0"]))
                recs.append(rec)
    if mode == "ours":
        mgr.wait()
        loop_s = now() - t_loop
        stats = [(r["call_s"], r["handle"].wait()) for r in recs]
        out = [{"stall_s": st.stall_s + st.wait_prev_s, "wait_prev_s": st.wait_prev_s, "call_s": call_s, "guard_wait_s": st.guard_wait_s,
                "durable_s": st.total_s, "snapshot_s": st.snapshot_s, "write_s": st.write_s, "commit_s": st.commit_s,
                "bytes_written": st.bytes_written} for call_s, st in stats]
        mgr.close()
    elif mode == "dcp":
        for f in pending:  # no optimizer step follows: nothing to wait for in the loop
            f.result()
        prev.result()
        loop_s = now() - t_loop
        time.sleep(0.05)  # the done-callback has run
        out = [{k: r[k] for k in ("stall_s", "durable_s", "wait_prev_s", "state_dict_s", "call_s")} for r in recs]
        stager.close()
    else:
        loop_s, out = now() - t_loop, []
    return {"loop_s": loop_s, "local_bytes": local, "global_bytes": glob, "saves": out,
            "placements": sorted({str(tuple(p.placements)) for p in model.parameters()})}


def _slowest_median(runs: list[list[dict]], key: str) -> float:
    """Median over every save of every run of the slowest rank's `key`."""
    return statistics.median(max(x["saves"][k][key] for x in r) for r in runs for k in range(len(r[0]["saves"])))


def bench_mesh2d(root: str, steps: int, every: int, sizes: dict = MESH2D) -> dict:
    """B ours dcp B dcp ours B: each config run is compared with the two no-save baselines around its block
    (the machine drifts), and each library runs once first and once second in its block."""
    order = ("baseline", "ours", "dcp", "baseline", "dcp", "ours", "baseline")
    runs: list[tuple[str, list[dict]]] = []
    for mode in order:
        d = os.path.join(root, f"mesh2d-{mode}")
        t = now()
        r = launch("mesh2d_worker", 4, root=d, mode=mode, steps=steps, every=every, sizes=sizes)
        shutil.rmtree(d, ignore_errors=True)
        runs.append((mode, r))
        print(f"mesh2d {mode}: loop {max(x['loop_s'] for x in r):.2f} s (launch to exit {now() - t:.1f} s)", flush=True)
    loops = [max(x["loop_s"] for x in r) for _, r in runs]
    bases = [loops[i] for i, (mode, _) in enumerate(runs) if mode == "baseline"]
    first = next(r for mode, r in runs if mode == "ours")
    saves = len(first[0]["saves"])
    summary = {"sizes": sizes, "steps": steps, "every": every, "baseline_loops_s": bases,
               "noise_per_save_s": max(abs(a - b) for a, b in zip(bases, bases[1:])) / saves / 2,
               "local_bytes": max(x["local_bytes"] for x in first), "global_bytes": first[0]["global_bytes"],
               "placements": first[0]["placements"]}
    for mode, extra in (("ours", ("call_s", "guard_wait_s", "snapshot_s", "write_s", "commit_s")), ("dcp", ("call_s", "state_dict_s"))):
        mine = [(i, r) for i, (m, r) in enumerate(runs) if m == mode]
        overheads = []
        for i, r in mine:  # the baselines before and after this run's block
            before = max(j for j in range(i) if runs[j][0] == "baseline")
            after = min(j for j in range(i, len(runs)) if runs[j][0] == "baseline")
            overheads.append((loops[i] - (loops[before] + loops[after]) / 2) / saves)
        summary[mode] = {"saves": saves * len(mine), "loop_overhead_per_save_s": statistics.mean(overheads), "loop_overhead_runs_s": overheads}
        for key in ("stall_s", "wait_prev_s", "durable_s") + extra:
            summary[mode][key] = _slowest_median([r for _, r in mine], key)
    summary["ours"]["bytes_written"] = statistics.median(sum(x["saves"][k]["bytes_written"] for x in r) for m, r in runs if m == "ours" for k in range(saves))
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["commit", "flatten", "merge", "reports", "sharded", "mesh2d", "all"])
    ap.add_argument("--root", default=os.path.join(os.path.dirname(__file__), "out", "dist"))
    ap.add_argument("--worlds", default="1,2,4,8")
    ap.add_argument("--saves", type=int, default=6)
    ap.add_argument("--tensors", type=int, default=64, help="commit: parameters, each sharded over every rank (with as many momentum buffers)")
    ap.add_argument("--mb", type=int, default=256, help="global parameter bytes (optimizer state doubles it)")
    ap.add_argument("--mesh2d-steps", type=int, default=15, help="mesh2d: timed training steps per run")
    ap.add_argument("--mesh2d-every", type=int, default=3, help="mesh2d: a save every this many steps")
    ap.add_argument("--md", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.root, exist_ok=True)
    out: dict = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count()}
    if a.what in ("commit", "all"):
        out["commit"] = bench_commit(a.root, [int(w) for w in a.worlds.split(",")], a.saves, a.tensors)
    if a.what in ("flatten", "all"):
        out["flatten"] = bench_flatten(a.tensors * 4, reps=20)
    if a.what in ("merge", "all"):
        out["merge"] = bench_merge(8, a.tensors * 8, [0, 300_000, 1_000_000, 3_000_000])
    if a.what == "reports":  # not in "all": it needs no ranks, only CPU time
        out["reports"] = bench_reports([int(w) for w in a.worlds.split(",")], a.tensors)
    if a.what in ("sharded", "all"):
        out["sharded"] = bench_sharded(a.root, a.mb << 20, steps=12, every=3, compute=384)
    if a.what in ("mesh2d", "all"):
        out["mesh2d"] = bench_mesh2d(a.root, steps=a.mesh2d_steps, every=a.mesh2d_every)
    Path(a.root, "bench_dist.json").write_text(json.dumps(out, indent=1))
    if a.md:
        print(markdown(out))
    else:
        print(json.dumps(out, indent=1))


def markdown(out: dict) -> str:
    lines = []
    if "commit" in out:
        lines += ["| ranks | parameters | manifest | commit (report + merge + COMMIT) | save() to committed | CPU per save: rank 0 | other ranks (max) |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['world']} | {r.get('tensors', 64)} | {r.get('manifest_bytes', 0) / 1e3:.0f} kB | {r['commit_s'] * 1e3:.1f} ms | {r['total_s'] * 1e3:.1f} ms "
                  f"| {r.get('cpu_rank0_s', 0) * 1e3:.1f} ms | {r.get('cpu_others_s', 0) * 1e3:.1f} ms |" for r in out["commit"]]
    if "flatten" in out:
        f = out["flatten"]
        lines += ["", f"save()'s walk over {f['leaves']} DTensors (flatten_state, one rank): {f['flatten_s'] * 1e3:.1f} ms, "
                  f"{f['flatten_s'] / f['leaves'] * 1e6:.0f} us per DTensor"]
    if "merge" in out:
        lines += ["", "| objects in the process | rank 0's merge, collector on | off |", "|---:|---:|---:|"]
        lines += [f"| {r['objects']:,} | {r['gc_on_s'] * 1e3:.1f} ms | {r['gc_off_s'] * 1e3:.1f} ms |" for r in out["merge"]]
    if "sharded" in out:
        s = out["sharded"]
        lines += ["", f"2 ranks, {s['local_bytes'] / 1e6:.0f} MB of state per rank (sharded params + momentum), baseline loop {s['baseline_loop_s']:.2f} s", "",
                  "| per save (slowest rank) | ours | DCP async_save (thread, reused stager, async staging) | ratio |", "|---|---|---|---|"]
        for k, label in (("stall_s", "training stall"), ("loop_overhead_per_save_s", "loop overhead"), ("durable_s", "save to committed")):
            o, d = s["ours"][k], s["dcp"][k]
            lines.append(f"| {label} | {o:.3f} s | {d:.3f} s | {o / d:.2f} |" if d > 0 else f"| {label} | {o:.3f} s | {d:.3f} s | |")
    if "mesh2d" in out:
        m = out["mesh2d"]
        z = m["sizes"]
        lines += ["", f"4 ranks, 2x2 (dp, tp) mesh, FSDP2 over tensor parallel as in examples/train_2d.py (vocab {z['vocab']}, dim {z['dim']}, "
                  f"{z['n_layers']} blocks): {m['global_bytes'] / 1e6:.0f} MB of parameters + AdamW state in all, {m['local_bytes'] / 1e6:.0f} MB on the "
                  f"largest rank; {m['steps']} steps, a save every {m['every']} (the last with at least {m['every']} steps after it); no-save loops {', '.join(f'{b:.2f}' for b in m['baseline_loops_s'])} s "
                  f"(neighbouring baselines differ by up to ±{m['noise_per_save_s']:.3f} s per save); {m['ours']['saves']} saves each. "
                  f"Placements: {', '.join(m['placements'])}", "",
                  "| per save (slowest rank) | ours | DCP async_save (get_state_dict, thread, reused stager, async staging) | ratio ours/DCP |", "|---|---|---|---|"]
        for k, label in (("stall_s", "training stall (incl. waiting for the previous save)"), ("wait_prev_s", "of which waiting for the previous save"),
                         ("loop_overhead_per_save_s", "loop overhead (loop time minus the no-save loops around it, per save; per run)"), ("durable_s", "save() to committed")):
            o, d = m["ours"][k], m["dcp"][k]
            if k == "loop_overhead_per_save_s":  # per run too: these are the noisy ones
                o_s, d_s = (f"{v:.3f} s ({', '.join(f'{x:.3f}' for x in m[lib]['loop_overhead_runs_s'])})" for lib, v in (("ours", o), ("dcp", d)))
            else:
                o_s, d_s = f"{o:.3f} s", f"{d:.3f} s"
            lines.append(f"| {label} | {o_s} | {d_s} | {o / d:.2f} |" if k != "wait_prev_s" and d > 0 else f"| {label} | {o_s} | {d_s} | |")
        o = m["ours"]
        d = m["dcp"]
        lines += ["", f"Medians of the slowest rank. Ours: save() call {o['call_s']:.3f} s, guard wait before the next optimizer.step() "
                  f"{o['guard_wait_s']:.3f} s; snapshot {o['snapshot_s']:.3f} s, write {o['write_s']:.3f} s, commit {o['commit_s']:.3f} s; "
                  f"{o['bytes_written'] / 1e6:.0f} MB written per save over all ranks. DCP: get_state_dict + async_save() call {d['call_s']:.3f} s "
                  f"(get_state_dict {d['state_dict_s']:.3f} s), the rest of its stall is the wait for staging before the next optimizer.step()."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
