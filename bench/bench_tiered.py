#!/usr/bin/env python
"""Remote-tier benchmark: local commit -> remote-durable for a ~1 GB step against a plain s3fs
upload of the same bytes, the training loop while a step uploads, and restore from each tier.

    python bench/bench_tiered.py                 # ~1 GB state, 3 rounds (a few minutes on 2 cores)
    python bench/bench_tiered.py --gb 0.25 --rounds 1     # smoke test

The S3 server is moto on 127.0.0.1 in a child process (examples/embedded_s3.py); pass --remote
s3://bucket/prefix plus AWS_* credentials in the environment to run against a real bucket instead.

1. Upload. Each round saves one step (keep_local=1, keep_remote=1) and waits for it: `upload_s`
   from SaveStats is local commit -> COMMIT on the remote tier (data, manifest, marker). A copy of
   the step's pack file (its page cache dropped first, as ours read it cold) goes up with plain
   s3fs `put_file`, twice: s3fs defaults, and s3fs with our part size and concurrency; rounds
   alternate which goes first. Throughput = bytes / seconds; the ratio ours / best s3fs is the
   number to watch (target >= 0.9).
2. Training loop while uploading. A small MLP trains on one thread; step times are taken with no
   checkpoint activity, while a save writes locally, while it uploads, and while a plain s3fs
   upload of the same bytes runs on a thread: the S3 server's CPU (a separate process here,
   remote in production) costs the same in both, so compare "ours" with that reference.
3. Restore. A fresh manager restores the step from the local tier (page cache dropped) and from
   the remote tier only (an empty local directory).
4. `--commit-check 64,1024`: only rank 0's check, before a remote COMMIT, that every rank's file of
   the step is there whole, for that many ranks' files: one HEAD per file against a listing.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (HERE, ROOT, os.path.join(ROOT, "examples")):
    if p not in sys.path:
        sys.path.insert(0, p)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import _common as C  # noqa: E402
from checkpointing import CheckpointManager  # noqa: E402

MiB = 1 << 20


def log(*a: object) -> None:
    print(*a, file=sys.stderr, flush=True)


def make_state(gb: float) -> dict:
    n = max(1, int(gb * 1e9 / (64 * MiB)))
    g = torch.Generator().manual_seed(0)
    return {"layers": [torch.randn(16 * MiB, generator=g) for _ in range(n)], "step": 0}


def s3fs(options: dict):
    import s3fs

    return s3fs.S3FileSystem(key=options.get("key"), secret=options.get("secret"), endpoint_url=options.get("endpoint_url"),
                             client_kwargs=options.get("client_kwargs"), skip_instance_cache=True)


def s3fs_upload(options: dict, local_path: str, url: str, **kwargs: object) -> float:
    fs = s3fs(options)
    C.evict(local_path)
    t0 = time.perf_counter()
    fs.put_file(local_path, url.removeprefix("s3://"), **kwargs)
    dt = time.perf_counter() - t0
    fs.rm(url.removeprefix("s3://"))
    return dt


def bench_upload(args: argparse.Namespace, url: str, options: dict, state: dict, work: str) -> dict:
    """Rounds alternate the order (ours first, then s3fs first) against drift in the server."""
    local = os.path.join(work, "upload")
    plain = os.path.join(work, "plain.bin")  # a copy of the first step's pack: what s3fs uploads
    rows = []
    with CheckpointManager(local, remote=f"{url}/ours", storage_options=options, keep_local=1, keep_remote=1,
                           upload_concurrency=args.concurrency, upload_part_bytes=args.part_mib * MiB) as mgr:
        for r in range(args.rounds):
            timings: dict[str, float] = {}

            def theirs() -> None:
                timings["default"] = s3fs_upload(options, plain, f"{url}/plain/x.pack")
                timings["same"] = s3fs_upload(options, plain, f"{url}/plain/y.pack", chunksize=args.part_mib * MiB,
                                              max_concurrency=args.concurrency)

            if r % 2 and os.path.exists(plain):
                theirs()
            state["step"] = r + 1
            st = mgr.save(r + 1, state).wait()
            sdir = os.path.join(local, f"step-{r + 1:010d}")
            pack = next(os.path.join(sdir, n) for n in os.listdir(sdir) if n.endswith(".pack"))
            if not os.path.exists(plain):
                shutil.copyfile(pack, plain)
            if "default" not in timings:
                theirs()
            nbytes = os.path.getsize(pack)
            row = {"bytes": nbytes, "ours_upload_s": st.upload_s, "ours_transfer_MBps": st.upload_bytes_per_s / 1e6,
                   "ours_MBps": nbytes / st.upload_s / 1e6, "s3fs_default_MBps": nbytes / timings["default"] / 1e6,
                   "s3fs_same_parts_MBps": nbytes / timings["same"] / 1e6, "local_commit_s": st.total_s}
            row["ratio_vs_best_s3fs"] = row["ours_MBps"] / max(row["s3fs_default_MBps"], row["s3fs_same_parts_MBps"])
            log(f"round {r + 1}: " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
            rows.append(row)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    best = max(med["s3fs_default_MBps"], med["s3fs_same_parts_MBps"])
    med["ratio_of_medians"] = med["ours_MBps"] / best
    return {"rounds": rows, "median": med}


class Loop:
    """A small MLP trained on this thread; records (time, step seconds)."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 512))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.x = torch.randn(256, 512)

    def step(self) -> float:
        t0 = time.perf_counter()
        loss = self.model(self.x).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return time.perf_counter() - t0


def bench_loop(args: argparse.Namespace, url: str, options: dict, state: dict, work: str) -> dict:
    """Step times: idle, while our save writes locally / uploads, and while a plain s3fs upload of the
    same bytes runs on a background thread (the reference: what any upload costs on this machine)."""
    torch.set_num_threads(args.loop_threads)
    loop = Loop()
    for _ in range(10):
        loop.step()
    base = [loop.step() for _ in range(args.loop_steps)]
    phases: dict[str, list[float]] = {"write": [], "upload": [], "s3fs": []}
    local = os.path.join(work, "loop")
    plain = os.path.join(work, "plain.bin")
    with CheckpointManager(local, remote=f"{url}/loop", storage_options=options, keep_local=1, keep_remote=1,
                           upload_concurrency=args.concurrency, upload_part_bytes=args.part_mib * MiB) as mgr:
        for r in range(args.rounds):
            state["step"] = 100 + r
            h = mgr.save(100 + r, state)
            while not h.done():
                dt = loop.step()
                phases["upload" if h.local_done() else "write"].append(dt)
            h.wait()
            base += [loop.step() for _ in range(20)]
            if not os.path.exists(plain):  # --only-loop: the upload part did not make it
                sdir = os.path.join(local, f"step-{100 + r:010d}")
                shutil.copyfile(next(os.path.join(sdir, n) for n in os.listdir(sdir) if n.endswith(".pack")), plain)
            C.evict(plain)
            t = threading.Thread(target=lambda: s3fs(options).put_file(plain, f"{url}/plain/z.pack".removeprefix("s3://"),
                                                                       chunksize=args.part_mib * MiB, max_concurrency=args.concurrency))
            t.start()
            while t.is_alive():
                phases["s3fs"].append(loop.step())
            base += [loop.step() for _ in range(20)]
    torch.set_num_threads(os.cpu_count() or 1)
    med = statistics.median(base)
    out = {"baseline_step_ms": med * 1e3}
    for name, xs in phases.items():
        if xs:
            out[f"{name}_step_ms"] = statistics.median(xs) * 1e3
            out[f"{name}_slowdown_pct"] = (statistics.median(xs) / med - 1) * 100
            out[f"{name}_steps"] = len(xs)
            out[f"{name}_lost_s_per_round"] = (sum(xs) - len(xs) * med) / args.rounds  # the loop's time lost, in all
    log("loop: " + ", ".join(f"{k}={v:.2f}" for k, v in out.items()))
    return out


def bench_restore(args: argparse.Namespace, url: str, options: dict, state: dict, work: str) -> dict:
    local = os.path.join(work, "upload")  # the last step of bench_upload: on both tiers
    target = {"layers": [torch.empty_like(t) for t in state["layers"]], "step": 0}
    out: dict[str, list[float]] = {"local_s": [], "remote_s": []}
    for _ in range(2):
        C.evict(local)
        with CheckpointManager(local, remote=f"{url}/ours", storage_options=options) as mgr:
            t0 = time.perf_counter()
            step = mgr.restore(target)
            out["local_s"].append(time.perf_counter() - t0)
        empty = tempfile.mkdtemp(dir=work)
        with CheckpointManager(empty, remote=f"{url}/ours", storage_options=options,
                               upload_concurrency=args.concurrency, upload_part_bytes=args.part_mib * MiB) as mgr:
            t0 = time.perf_counter()
            assert mgr.restore(target) == step
            out["remote_s"].append(time.perf_counter() - t0)
        shutil.rmtree(empty)
    assert all(torch.equal(a, b) for a, b in zip(target["layers"], state["layers"]))
    nbytes = sum(t.numel() * 4 for t in state["layers"])
    res = {k: min(v) for k, v in out.items()}
    res.update(local_GBps=nbytes / res["local_s"] / 1e9, remote_GBps=nbytes / res["remote_s"] / 1e9)
    log("restore: " + ", ".join(f"{k}={v:.3f}" for k, v in res.items()))
    return res


def markdown(result: dict) -> str:
    up, loop, rest = result["upload"]["median"], result["loop"], result["restore"]
    lines = [
        f"Remote tier ({result['date']}, {result['machine']}; S3 = {result['s3']}; state {up['bytes'] / 1e9:.2f} GB, "
        f"upload_concurrency={result['args']['concurrency']}, upload_part_bytes={result['args']['part_mib']} MiB; "
        f"medians of {result['args']['rounds']} rounds)",
        "",
        "| measure | value |",
        "| --- | --- |",
        f"| local commit -> remote-durable (ours) | {up['ours_upload_s']:.2f} s = {up['ours_MBps']:.0f} MB/s |",
        f"| plain s3fs put_file, defaults | {up['s3fs_default_MBps']:.0f} MB/s |",
        f"| plain s3fs put_file, same part size and concurrency | {up['s3fs_same_parts_MBps']:.0f} MB/s |",
        f"| ours / best s3fs (median of per-round ratios; ratio of medians) | {up['ratio_vs_best_s3fs']:.2f}x; {up['ratio_of_medians']:.2f}x |",
        f"| training step, no checkpoint | {loop['baseline_step_ms']:.1f} ms |",
    ]
    what = {"write": "while our save writes locally", "upload": "while our save uploads",
            "s3fs": "while a plain s3fs upload runs in a thread (reference)"}
    for name, text in what.items():
        if f"{name}_step_ms" in loop:
            lines.append(f"| training step {text} | {loop[f'{name}_step_ms']:.1f} ms ({loop[f'{name}_slowdown_pct']:+.1f}%, "
                         f"{loop[f'{name}_steps']:.0f} steps; the loop lost {loop[f'{name}_lost_s_per_round']:.2f} s per round) |")
    lines += [
        f"| restore from the local tier (page cache dropped) | {rest['local_s']:.2f} s ({rest['local_GBps']:.2f} GB/s) |",
        f"| restore from the remote tier only | {rest['remote_s']:.2f} s ({rest['remote_GBps']:.2f} GB/s) |",
    ]
    return "\n".join(lines) + "\n"


def bench_commit_check(url: str, options: dict, counts: list[int], rounds: int) -> list[dict]:
    """Before a step commits on the remote tier, rank 0 checks each rank's file of it is there whole
    (catalog.size_mismatches): N small objects in one step directory, checked one HEAD each (as
    before Storage.sizes) and as the code does it now (a listing per directory), alternating."""
    from checkpointing.storage import FsspecStorage, sizes
    from checkpointing.tier import catalog

    rows = []
    for n in counts:
        remote = FsspecStorage(f"{url}/check-{n}", options)
        files = [(f"step-0000000001/r{r:05d}.0123456789ab.pack", 64 + r) for r in range(n)]
        for path, size in files:
            remote.put(path, b"\0" * size)
        times: dict[str, list[float]] = {"one HEAD per file": [], "listed (now)": []}
        for _ in range(rounds):
            for label in times:
                t0 = time.perf_counter()
                if label == "listed (now)":
                    bad = list(catalog.size_mismatches(remote, files))
                else:
                    found = sizes.one_by_one(remote, [p for p, _ in files])
                    bad = [p for p, size in files if found[p] != size]
                times[label].append(time.perf_counter() - t0)
                assert not bad, bad
        row = {"files": n, **{k: statistics.median(v) for k, v in times.items()}}
        rows.append(row)
        log(f"commit check of {n} files: " + ", ".join(f"{k} {row[k]:.3f} s" for k in times))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=1.0, help="state size")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--part-mib", type=int, default=64)
    ap.add_argument("--loop-steps", type=int, default=60)
    ap.add_argument("--loop-threads", type=int, default=1, help="torch threads of the training loop (2 here: every CPU busy)")
    ap.add_argument("--only-loop", action="store_true", help="only the training-loop part (2.)")
    ap.add_argument("--remote", default=None, help="s3://bucket/prefix of a real bucket (credentials from the environment)")
    ap.add_argument("--dir", default=None, help="local tier parent directory (default: a temporary one)")
    ap.add_argument("--json", default=os.path.join(ROOT, "bench", "out", "bench_tiered.json"))
    ap.add_argument("--md", default=None, help="also write the markdown table here")
    ap.add_argument("--commit-check", default=None, metavar="N,N",
                    help="only the remote commit's check that every rank's file is there, for N ranks' files (one HEAD each, or listed)")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="bench-tiered-", dir=args.dir)
    server = None
    try:
        if args.remote:
            url, options, s3 = args.remote.rstrip("/"), {}, "a real bucket"
        else:
            from embedded_s3 import EmbeddedS3

            server = EmbeddedS3()
            server.start()
            url, options, s3 = server.bucket("bench"), server.storage_options, "moto on 127.0.0.1 (child process)"
        if args.commit_check:
            result = {"commit_check": bench_commit_check(url, options, [int(n) for n in args.commit_check.split(",")], args.rounds)}
            print(json.dumps(result, indent=1))
            return
        log(f"state {args.gb} GB, work dir {work}, remote {url}")
        state = make_state(args.gb)
        result = {
            "date": datetime.date.today().isoformat(), "s3": s3,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.processor() or platform.platform()}",
            "args": vars(args),
        }
        if not args.only_loop:
            result["upload"] = bench_upload(args, url, options, state, work)
        result["loop"] = bench_loop(args, url, options, state, work)
        if not args.only_loop:
            result["restore"] = bench_restore(args, url, options, state, work)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    md = markdown(result) if not args.only_loop else json.dumps(result["loop"], indent=1) + "\n"
    print(md)
    if args.md:
        with open(args.md, "w") as f:
            f.write(md)


if __name__ == "__main__":
    threading.current_thread().name = "bench"
    main()
