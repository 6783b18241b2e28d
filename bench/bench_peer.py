#!/usr/bin/env python
"""Peer-copy benchmark: restore after node loss from a peer copy vs the remote tier vs the local tier,
and the training loop while peer copies stream (paced and unpaced).

    python bench/bench_peer.py                    # 128 MB per node, 2 rounds (~3 minutes on 2 cores)
    python bench/bench_peer.py --mb 32 --rounds 1 # smoke test

Two ranks (gloo on 127.0.0.1), one per "node": each has its own local directory, peer_copies=1 (each
node's steps are also committed on the other's disk). The S3 server is moto on 127.0.0.1 in a child
process (examples/embedded_s3.py).

1. Restore after node loss. Both nodes save one step (local, peer, remote) and wait. Then per round:
   - local: a fresh job restores with every disk intact (page cache of node 1 dropped first);
   - peer: node 1's directory is deleted; a fresh job restores: node 1 fetches its replica back
     from node 0 (verified, committed in its own peer area) and reads it (node 0's copy's page cache
     dropped first, so the copy is read from disk as after a real failure);
   - remote: node 1's directory is deleted again; a fresh job with peer_copies=0 restores: node 1
     reads its shards from S3.
   Times are rank 1's restore() (the lost node), collective work included.
2. Training loop while copies stream. Rank 0 trains a small MLP on one thread (the other core stays
   free for background work, as a node's spare cores would); both ranks save a state whose bytes
   all changed (so every copy sends the whole pack, both ways); rank 0's step times with no
   checkpoint activity, while the save writes locally, and while the peer copies stream, unpaced
   and with peer_bandwidth (two managers taking turns in one job, so both see the same machine).
Results: bench/out/peer.md (and peer.json).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (HERE, ROOT, os.path.join(ROOT, "examples")):
    if p not in sys.path:
        sys.path.insert(0, p)

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402

import _common as C  # noqa: E402

MiB = 1 << 20


def log(*a: object) -> None:
    print(*a, file=sys.stderr, flush=True)


def make_state(mb: int, rank: int) -> dict:
    g = torch.Generator().manual_seed(rank)
    n = max(1, mb // 16)
    return {"layers": [torch.randn(4 * MiB, generator=g) for _ in range(n)], "rank": rank}


class Loop:
    """A small MLP training step on one thread (what the checkpoint must not slow down)."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 512))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.x = torch.randn(128, 512)

    def step(self) -> float:
        t0 = time.perf_counter()
        self.model(self.x).square().mean().backward()
        self.opt.step()
        self.opt.zero_grad()
        return time.perf_counter() - t0


# ----------------------------------------------------------------------------- the ranks


def _manager(base: str, rank: int, **kwargs: object):
    from checkpointing import CheckpointManager

    return CheckpointManager(f"{base}/node{rank}", timeout_s=120, **kwargs)


def _remote(cfg: dict) -> dict:
    return {"remote": cfg["url"], "storage_options": cfg["options"], "upload_part_bytes": 16 * MiB}


def rank_main(rank: int, port: int, kind: str, cfg: dict, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    result = RANK_JOBS[kind](rank, cfg)
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def job_save(rank: int, cfg: dict) -> dict:
    with _manager(cfg["base"], rank, peer_copies=1, keep_local=None, **_remote(cfg)) as mgr:
        stats = mgr.save(1, make_state(cfg["mb"], rank)).wait()
        return {"tiers": {str(k): v for k, v in mgr.tiers().items()}, "bytes": stats.bytes_total}


def job_restore(rank: int, cfg: dict) -> dict:
    state = make_state(cfg["mb"], rank)
    target = {"layers": [torch.empty_like(t) for t in state["layers"]], "rank": -1}
    with _manager(cfg["base"], rank, peer_copies=cfg["peers"], keep_local=None, **_remote(cfg)) as mgr:
        t0 = time.perf_counter()
        step = mgr.restore(target)
        seconds = time.perf_counter() - t0
    assert step == 1 and all(torch.equal(a, b) for a, b in zip(target["layers"], state["layers"])), "restore is not bit-exact"
    return {"seconds": seconds}


def job_loop(rank: int, cfg: dict) -> dict:
    """Rank 0 trains (on one thread: the other core stays free for background work, as a node's spare
    cores would); rank 1 only saves. Two managers (unpaced, and paced at cfg["bandwidth"]) take
    turns, so both modes see the same machine. Per round and mode: steps with nothing in flight on
    either rank, then a save whose every byte changed (the copies send the whole pack, both ways)
    while rank 0 trains on. The ranks meet at a barrier between phases."""
    import torch.distributed as dist

    loop = Loop()
    for _ in range(10):
        loop.step()
    modes = {"unpaced": None, "paced": cfg["bandwidth"]}
    phases = {m: {"idle": [], "write": [], "copy": [], "copy_s": []} for m in modes}
    state = make_state(cfg["mb"], rank)
    managers = {m: _manager(f"{cfg['base']}/{m}", rank, peer_copies=1, keep_local=1, peer_bandwidth=bw) for m, bw in modes.items()}
    try:
        for r in range(cfg["rounds"]):
            for m, mgr in managers.items():
                dist.barrier()
                phases[m]["idle"] += [loop.step() for _ in range(30)] if rank == 0 else []
                for t in state["layers"]:
                    t.add_(1.0)
                dist.barrier()
                handle = mgr.save(10 + r, state)
                while not handle.done():
                    if rank == 0:
                        dt = loop.step()
                        phases[m]["write" if not handle.local_done() else "copy"].append(dt)
                    else:
                        time.sleep(0.005)
                handle.wait()
                assert handle.peer is not None
                phases[m]["copy_s"].append(max(x.seconds for x in handle.peer.results))
    finally:
        for mgr in managers.values():
            mgr.close()
    return phases


RANK_JOBS = {"save": job_save, "restore": job_restore, "loop": job_loop}


def run_job(kind: str, cfg: dict, work: str) -> list[dict]:
    out = tempfile.mkdtemp(dir=work)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(r, port, kind, cfg, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
    if any(p.exitcode != 0 for p in procs):
        raise SystemExit(f"the {kind} job failed: exit codes {[p.exitcode for p in procs]}")
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in (0, 1)]


# ----------------------------------------------------------------------------- the parts


def bench_restore(args: argparse.Namespace, cfg: dict, work: str) -> dict:
    base = Path(cfg["base"])
    saved = run_job("save", cfg, work)
    log(f"saved: {saved}")
    times: dict[str, list[float]] = {"local": [], "peer": [], "remote": []}
    for r in range(args.rounds):
        C.evict(str(base / "node1"))
        times["local"].append(run_job("restore", dict(cfg, peers=1), work)[1]["seconds"])
        shutil.rmtree(base / "node1")
        C.evict(str(base / "node0" / "peers"))
        times["peer"].append(run_job("restore", dict(cfg, peers=1), work)[1]["seconds"])
        shutil.rmtree(base / "node1")
        times["remote"].append(run_job("restore", dict(cfg, peers=0), work)[1]["seconds"])
        log("restore (rank 1, s): " + ", ".join(f"{k}={v[-1]:.3f}" for k, v in times.items()))
        if r + 1 < args.rounds:  # node 1 back from its peer, for the next round's 'local'
            shutil.rmtree(base / "node1")
            run_job("restore", dict(cfg, peers=1), work)
    res = {k: statistics.median(v) for k, v in times.items()}
    res["bytes_per_node"] = saved[1]["bytes"]
    res["all"] = times
    return res


def bench_loop(args: argparse.Namespace, cfg: dict, work: str) -> dict:
    ranks = run_job("loop", dict(cfg, base=os.path.join(work, "loop"), bandwidth=args.paced_mbps * 1e6, rounds=args.rounds + 1), work)
    out = {}
    base = statistics.median([x for name in ("unpaced", "paced") for x in ranks[0][name]["idle"]])  # one baseline for both
    for name in ("unpaced", "paced"):
        merged = {k: ranks[0][name][k] for k in ("idle", "write", "copy")}
        merged["copy_s"] = [x for r in ranks for x in r[name]["copy_s"]]
        row = {"idle_ms": base * 1e3, "own_idle_ms": statistics.median(merged["idle"]) * 1e3, "copy_s": statistics.median(merged["copy_s"])}
        for phase in ("write", "copy"):
            if merged[phase]:
                row[f"{phase}_ms"] = statistics.median(merged[phase]) * 1e3
                row[f"{phase}_pct"] = (statistics.median(merged[phase]) / base - 1) * 100
                row[f"{phase}_steps"] = len(merged[phase])
        out[name] = row
        log(f"loop {name}: " + ", ".join(f"{k}={v:.2f}" for k, v in row.items()))
    return out


def markdown(result: dict) -> str:
    r, loop = result["restore"], result["loop"]
    mb = r["bytes_per_node"] / 1e6
    lines = [
        f"Peer copies ({result['date']}, {result['machine']}; 2 ranks on one machine, one per node-local directory, "
        f"gloo on 127.0.0.1; S3 = moto on 127.0.0.1; {mb:.0f} MB per node; medians of {result['args']['rounds']} rounds)",
        "",
        "Restore after node loss (rank 1's restore(), the lost node; collective work included):",
        "",
        "| restore of node 1 from | time | vs remote |",
        "| --- | ---: | ---: |",
        f"| its own local tier (nothing lost; page cache dropped) | {r['local']:.2f} s | {r['local'] / r['remote']:.2f}x |",
        f"| a peer copy (fetched back from node 0, verified, then read) | {r['peer']:.2f} s | {r['peer'] / r['remote']:.2f}x |",
        f"| the remote tier (S3) | {r['remote']:.2f} s | 1.00x |",
        "",
        f"Training step of rank 0 while peer copies stream ({mb:.0f} MB per node per save, every byte changed, both "
        "nodes copying to each other; rank 0 trains on one thread, rank 1 only saves; both share the machine's 2 cores):",
        "",
        f"Training step with nothing in flight on either rank: {loop['unpaced']['idle_ms']:.1f} ms (median of every idle "
        f"phase of both modes, which took turns in one job; the idle phases before each mode's saves alone: "
        f"{loop['unpaced']['own_idle_ms']:.1f} / {loop['paced']['own_idle_ms']:.1f} ms, the machine's noise).",
        "",
        "| copies | step while writing locally | step while copies stream | copy time (per node) |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, text in (("unpaced", "unpaced"), ("paced", f"peer_bandwidth={result['args']['paced_mbps']:.0f} MB/s")):
        row = loop[name]
        w = f"{row['write_ms']:.1f} ms ({row['write_pct']:+.0f}%)" if "write_ms" in row else "-"
        c = f"{row['copy_ms']:.1f} ms ({row['copy_pct']:+.0f}%, {row['copy_steps']} steps)" if "copy_ms" in row else "-"
        lines.append(f"| {text} | {w} | {c} | {row['copy_s']:.2f} s |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=128, help="state per node (MB)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--paced-mbps", type=float, default=40.0, help="peer_bandwidth of the paced run (MB/s)")
    ap.add_argument("--dir", default=None, help="parent of the work directory (default: a temporary one)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "out"))
    args = ap.parse_args()
    from embedded_s3 import EmbeddedS3

    work = tempfile.mkdtemp(prefix="bench-peer-", dir=args.dir)
    server = EmbeddedS3()
    try:
        server.start()
        cfg = {"base": os.path.join(work, "restore"), "mb": args.mb, "url": server.bucket("bench") + "/peer",
               "options": server.storage_options, "peers": 1, "bandwidth": None, "rounds": args.rounds}
        result = {
            "date": datetime.date.today().isoformat(),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.processor() or platform.platform()}",
            "args": vars(args),
        }
        t0 = time.perf_counter()
        result["restore"] = bench_restore(args, cfg, work)
        result["loop"] = bench_loop(args, cfg, work)
        result["wall_s"] = time.perf_counter() - t0
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    os.makedirs(args.out, exist_ok=True)
    Path(args.out, "peer.json").write_text(json.dumps(result, indent=1))
    text = markdown(result)
    Path(args.out, "peer.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
