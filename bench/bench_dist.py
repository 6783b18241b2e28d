"""Multi-rank benchmark: real processes on gloo (127.0.0.1), ours against DCP async_save.

    python bench/bench_dist.py commit        # commit time at 1, 2, 4, 8 ranks, small sharded state
    python bench/bench_dist.py sharded       # 2 ranks, a sharded state: per-rank stall and time to commit
    python bench/bench_dist.py all --md      # both, as markdown for docs/benchmarks.md

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


def commit_worker(rank: int, world: int, root: str, saves: int) -> dict:
    from checkpointing import CheckpointManager

    params, opt = sharded_state(world, 8 << 20, 64)
    out = []
    with CheckpointManager(root, keep_local=1, timeout_s=120) as mgr:
        for step in range(saves):
            st = mgr.save(step, {"params": params, "optim": opt, "meta": {"step": step}}).wait()
            out.append({"commit_s": st.commit_s, "total_s": st.total_s})
    return {"commit_s": statistics.median(r["commit_s"] for r in out[1:]), "total_s": statistics.median(r["total_s"] for r in out[1:])}


def bench_commit(root: str, worlds: list[int], saves: int) -> list[dict]:
    rows = []
    for world in worlds:
        d = os.path.join(root, f"commit-{world}")
        res = launch("commit_worker", world, root=d, saves=saves)
        rows.append({"world": world, "commit_s": max(r["commit_s"] for r in res), "total_s": max(r["total_s"] for r in res)})
        shutil.rmtree(d, ignore_errors=True)
        print(f"commit  world={world}: commit {rows[-1]['commit_s'] * 1e3:.1f} ms, save->committed {rows[-1]['total_s'] * 1e3:.1f} ms", flush=True)
    return rows


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["commit", "sharded", "all"])
    ap.add_argument("--root", default=os.path.join(os.path.dirname(__file__), "out", "dist"))
    ap.add_argument("--worlds", default="1,2,4,8")
    ap.add_argument("--saves", type=int, default=6)
    ap.add_argument("--mb", type=int, default=256, help="global parameter bytes (optimizer state doubles it)")
    ap.add_argument("--md", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.root, exist_ok=True)
    out: dict = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count()}
    if a.what in ("commit", "all"):
        out["commit"] = bench_commit(a.root, [int(w) for w in a.worlds.split(",")], a.saves)
    if a.what in ("sharded", "all"):
        out["sharded"] = bench_sharded(a.root, a.mb << 20, steps=12, every=3, compute=384)
    Path(a.root, "bench_dist.json").write_text(json.dumps(out, indent=1))
    if a.md:
        print(markdown(out))
    else:
        print(json.dumps(out, indent=1))


def markdown(out: dict) -> str:
    lines = []
    if "commit" in out:
        lines += ["| ranks | commit (report + merge + COMMIT) | save() to committed |", "|---|---|---|"]
        lines += [f"| {r['world']} | {r['commit_s'] * 1e3:.1f} ms | {r['total_s'] * 1e3:.1f} ms |" for r in out["commit"]]
    if "sharded" in out:
        s = out["sharded"]
        lines += ["", f"2 ranks, {s['local_bytes'] / 1e6:.0f} MB of state per rank (sharded params + momentum), baseline loop {s['baseline_loop_s']:.2f} s", "",
                  "| per save (slowest rank) | ours | DCP async_save (thread, reused stager, async staging) | ratio |", "|---|---|---|---|"]
        for k, label in (("stall_s", "training stall"), ("loop_overhead_per_save_s", "loop overhead"), ("durable_s", "save to committed")):
            o, d = s["ours"][k], s["dcp"][k]
            lines.append(f"| {label} | {o:.3f} s | {d:.3f} s | {o / d:.2f} |" if d > 0 else f"| {label} | {o:.3f} s | {d:.3f} s | |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
