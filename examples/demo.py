#!/usr/bin/env python3
"""checkpointing demo: asynchronous checkpoints, a hard crash, a verified resume, and a lost node.

What it does (about 20-40 s on 2 CPU cores):

1. Run 1 trains a small MLP (~3.1 M parameters, ~38 MB of model + AdamW state) on synthetic
   data in a *child process*, saving an asynchronous checkpoint every few steps. Right after one
   save() returns (while that save is still being written in the background) the child kills its
   own process group with SIGKILL: no atexit, no flush, no clean shutdown.
2. Run 2 (this process, a fresh model and optimizer) restores the newest *committed* step and
   trains to the end. The interrupted save has no COMMIT marker and is invisible to restore.
3. It prints the steps on disk, the restored step, the losses around the resume point (the
   replayed steps reproduce the crashed run's losses: data, dropout RNG, optimizer and LR
   schedule all come back) and a stall table built from metrics.jsonl / mgr.stats().
4. The remote tier: every committed step is also uploaded in the background to S3 (by default an
   embedded moto server on 127.0.0.1 that the demo starts and stops). Then the node is "lost": the
   demo deletes its local directory, and a fresh manager restores the newest step from object
   storage alone, bit for bit.
5. Every save carries the step's loss (save(..., metrics={"loss": ...})), and the directory it ends
   with holds the run's metrics.jsonl: `checkpointing report DIR` explains what each save cost, and
   (with --remote none: after the lost node the steps are on the remote tier only) `checkpointing
   ls DIR` lists the steps with their loss. The demo prints the commands to try.
6. --peers: another scenario instead, two simulated nodes with peer copies. Two processes (gloo on
   127.0.0.1), each a "node" with its own local directory (DIR/node0, DIR/node1), train and save
   with CheckpointManager(..., peer_copies=1): every committed step is also committed on the other
   node's disk. Then node 1's directory is deleted, a fresh job restores (node 1 fetches its step
   back from node 0's copy, verified, bit for bit), and, with a remote tier, node 1 is lost once
   more and restores from object storage alone, to compare the two restore times.

Usage:  python examples/demo.py [--dir ./demo-run/ckpt] [--steps 60] [--every 5] [--kill-after 30]
                                [--remote embedded | s3://bucket/prefix | none] [--quick] [--peers]
--quick: a tiny model and 12 steps (a few seconds; what the tests run).
A real bucket: --remote s3://bucket/prefix with credentials in the environment (AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION, or AWS_PROFILE; AWS_ENDPOINT_URL for S3-compatible
stores); use an empty prefix. See the README, "A durable copy in object storage".
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

try:
    import checkpointing  # noqa: F401
    from checkpointing import CheckpointManager
except ImportError:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from checkpointing import CheckpointManager
from checkpointing import RNGState

import torch
import torch.nn as nn

# ----------------------------------------------------------------------------- the training job
D_IN, HIDDEN, DEPTH, BATCH = 512, 1024, 2, 256
KEEP_LOCAL = 3
KEEP_REMOTE = 6


def use_quick_sizes() -> None:
    """--quick: a tiny model and batch (the demo's flow is the same; its numbers are not representative)."""
    global D_IN, HIDDEN, BATCH
    D_IN, HIDDEN, BATCH = 32, 64, 16


def make_model() -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(D_IN, HIDDEN), nn.GELU()]
    for _ in range(DEPTH):
        layers += [nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.Dropout(0.1)]
    layers += [nn.Linear(HIDDEN, D_IN)]
    return nn.Sequential(*layers)


class Teacher:
    """A fixed random function to regress onto; batch `s` depends only on `s` (replayable)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1234)
        width = min(256, HIDDEN)
        self.w1 = torch.randn(D_IN, width, generator=g) / math.sqrt(D_IN)
        self.w2 = torch.randn(width, D_IN, generator=g) / math.sqrt(width)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(100_000 + step)
        x = torch.randn(BATCH, D_IN, generator=g)
        return x, torch.tanh(x @ self.w1) @ self.w2


def build_state(total_steps: int, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = make_model()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    warmup = 10
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim,
        lambda s: min(1.0, (s + 1) / warmup)
        * 0.5 * (1 + math.cos(math.pi * min(s, total_steps) / total_steps)),
    )
    # Everything the job needs to continue exactly where it left off.
    return {"model": model, "optim": optim, "sched": sched, "rng": RNGState()}


def train(mgr: CheckpointManager, state: dict, first: int, last: int, every: int, emit,
          kill_after: int | None = None) -> None:
    model, optim, sched = state["model"], state["optim"], state["sched"]
    teacher = Teacher()
    model.train()
    for step in range(first, last + 1):
        t0 = time.perf_counter()
        x, y = teacher.batch(step)
        loss = nn.functional.mse_loss(model(x), y)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()  # with snapshot="async" this is where a pending snapshot copy is guarded
        sched.step()
        t1 = time.perf_counter()
        ev = {"ev": "step", "step": step, "loss": loss.item(), "step_s": t1 - t0}
        if step % every == 0:
            mgr.save(step, state, metrics={"loss": loss.item()})  # returns once the loop may go on; writing continues behind
            ev["save_call_s"] = time.perf_counter() - t1
        emit(ev)
        if kill_after is not None and step == kill_after:
            # Crash hard while the save just issued is (most likely) still being written.
            emit({"ev": "kill", "step": step})
            os.killpg(os.getpgrp(), signal.SIGKILL)


def tier_kwargs() -> dict:
    """Manager arguments for the tiers; the remote URL and its options travel to the child in the environment."""
    kwargs: dict = {"keep_local": KEEP_LOCAL}
    url = os.environ.get("CKPT_DEMO_REMOTE")
    if url:
        kwargs.update(remote=url, keep_remote=KEEP_REMOTE, storage_options=json.loads(os.environ.get("CKPT_DEMO_OPTIONS") or "{}"))
    return kwargs


def start_remote(choice: str, con) -> tuple[object | None, str | None]:
    """(server to stop at the end, remote URL) for --remote; sets the environment the child reads."""
    if choice == "none":
        return None, None
    if choice == "embedded":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from embedded_s3 import EmbeddedS3

        server = EmbeddedS3()
        try:
            server.start()
        except RuntimeError as exc:
            con.print(f"[yellow]no remote tier[/]: {exc}")
            return None, None
        url = server.bucket("demo") + "/run1"
        os.environ["CKPT_DEMO_OPTIONS"] = json.dumps(server.storage_options)
        con.print(f"remote tier: embedded S3 (moto) at {server.endpoint}, bucket {url}")
    else:
        from checkpointing import catalog
        from checkpointing.storage import open_storage

        server, url = None, choice
        if catalog.list_steps(open_storage(url)).committed:
            sys.exit(f"{url} already holds checkpoints: pass an empty prefix for the demo")
        con.print(f"remote tier: {url} (credentials from the environment)")
    os.environ["CKPT_DEMO_REMOTE"] = url
    return server, url


def tier_table(tiers: dict):
    from rich.table import Table

    t = Table()
    t.add_column("step", justify="right")
    t.add_column("durable on")
    for step, where in tiers.items():
        t.add_row(str(step), {"local": "[yellow]local[/]", "remote": "[cyan]remote[/]"}.get(where, f"[green]{where}[/]"))
    return t


# ----------------------------------------------------------------------------- run 1 (the child)
def child_main(args: argparse.Namespace) -> None:
    def emit(ev: dict) -> None:
        sys.stdout.write(json.dumps(ev) + "\n")
        sys.stdout.flush()

    state = build_state(args.steps)
    mgr = CheckpointManager(args.dir, snapshot="async", **tier_kwargs())
    emit({"ev": "start", "pid": os.getpid()})
    train(mgr, state, 1, args.steps, args.every, emit, kill_after=args.kill_after)
    mgr.close()  # not reached when --kill-after <= --steps


# ----------------------------------------------------------------------------- the parent
def wipe(path: Path) -> None:
    if not path.exists():
        return
    if path.is_dir():
        entries = list(path.iterdir())
        looks_like_ckpt = not entries or any(
            e.name.startswith("step-") or e.name == "metrics.jsonl" for e in entries)
        if looks_like_ckpt and path.resolve() not in (Path.cwd().resolve(), Path.home().resolve()):
            shutil.rmtree(path)
            return
    sys.exit(f"refusing to wipe {path}: it does not look like a checkpoint directory")


def disk_listing(path: Path) -> list[tuple[str, bool]]:
    out = []
    if path.is_dir():
        for d in sorted(path.iterdir()):
            if d.is_dir() and d.name.startswith("step-"):
                out.append((d.name, (d / "COMMIT").exists()))
    return out


def read_metrics(path: Path) -> list[dict]:
    rows = []
    f = path / "metrics.jsonl"
    if f.exists():
        for line in f.read_text().splitlines():
            line = line.strip()
            if line:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:  # a torn last line after the crash
                    pass
    return rows


def rate(bytes_per_s: float) -> str:
    """MB/s, or "-" where unknown (a save recorded by the next process: its times are not known)."""
    return "-" if math.isnan(bytes_per_s) else f"{bytes_per_s / 1e6:,.0f}"


def num(d: dict, k: str) -> float:
    v = d.get(k)
    return float(v) if isinstance(v, (int, float)) else float("nan")


def ms(v: float) -> str:
    return "-" if math.isnan(v) else f"{v * 1e3:,.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=None, help="checkpoint directory (wiped first; default ./demo-run/ckpt, with --peers "
                    "./demo-run/peers holding node0/ and node1/)")
    ap.add_argument("--steps", type=int, default=None, help="training steps (default 60; 12 with --quick)")
    ap.add_argument("--every", type=int, default=None, help="save every N steps (default 5; 3 with --quick)")
    ap.add_argument("--kill-after", type=int, default=None,
                    help="run 1 SIGKILLs itself right after this step's save (default: ~half way)")
    ap.add_argument("--remote", default="embedded",
                    help="remote tier: 'embedded' (moto S3 on 127.0.0.1, started and stopped here), an s3://bucket/prefix "
                         "URL (credentials from the environment), or 'none'")
    ap.add_argument("--quick", action="store_true", help="a tiny model and 12 steps: the whole flow in a few seconds")
    ap.add_argument("--peers", action="store_true", help="the two-node scenario with peer copies (a lost node restores from "
                    "its neighbour's disk) instead of the crash/resume flow")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--peer-child", choices=("train", "peer", "remote"), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.dir = args.dir or ("./demo-run/peers" if args.peers or args.peer_child else "./demo-run/ckpt")
    if args.quick:
        use_quick_sizes()
    args.steps = args.steps or (12 if args.quick else 60)
    args.every = args.every or (3 if args.quick else 5)
    if args.kill_after is None:
        args.kill_after = max(args.every, (args.steps // 2) // args.every * args.every)
    if args.child:
        return child_main(args)
    if args.peer_child:
        return peer_child_main(args)

    from rich.console import Console

    con = Console(highlight=False, width=None if sys.stdout.isatty() else 112)
    ckpt = Path(args.dir)
    wipe_nodes(ckpt) if args.peers else wipe(ckpt)
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    n_params = sum(p.numel() for p in make_model().parameters())
    con.rule("[bold]checkpointing demo")
    con.print(f"model: MLP {D_IN}-{HIDDEN}x{DEPTH}-{D_IN}, {n_params / 1e6:.2f} M params, "
              f"~{n_params * 4 * 3 / 1e6:.0f} MB of model + AdamW state; {args.steps} steps, "
              f"async save every {args.every} steps into {ckpt} (keep_local={KEEP_LOCAL})")
    server, remote_url = start_remote(args.remote, con)
    try:
        if args.peers:
            run_peers(args, con, ckpt, remote_url)
        else:
            run_demo(args, con, ckpt, t_start, remote_url)
    finally:
        if server is not None:
            server.stop()
            con.print("[dim]embedded S3 server stopped[/]")


def run_demo(args: argparse.Namespace, con, ckpt: Path, t_start: float, remote_url: str | None) -> None:
    from rich.table import Table

    # --- run 1: a child process that crashes itself ------------------------------------------
    con.print(f"\n[bold]run 1[/]: child process, will SIGKILL itself right after save({args.kill_after}) returns")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--dir", str(ckpt),
           "--steps", str(args.steps), "--every", str(args.every),
           "--kill-after", str(args.kill_after)] + (["--quick"] if args.quick else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
    run1: dict[int, dict] = {}
    assert proc.stdout is not None
    for line in proc.stdout:
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:
            con.print(f"  [dim]child: {line.rstrip()}[/]")
            continue
        if ev["ev"] == "step":
            run1[ev["step"]] = ev
            if "save_call_s" in ev:
                con.print(f"  step {ev['step']:3d}  loss {ev['loss']:.5f}  "
                          f"save({ev['step']}) returned after {ev['save_call_s'] * 1e3:.1f} ms")
        elif ev["ev"] == "kill":
            con.print(f"  step {ev['step']:3d}  [red]os.killpg(SIGKILL)[/] while save({ev['step']}) may still be writing")
    rc = proc.wait()
    if rc == -signal.SIGKILL:
        con.print(f"[red]run 1 died[/]: child pid {proc.pid} was killed by SIGKILL (exit status {rc}) "
                  f"after step {max(run1, default=0)}")
    else:
        sys.exit(f"run 1 was expected to die by SIGKILL, but exited with status {rc}")
    n_metrics_run1 = len(read_metrics(ckpt))

    con.print("\non disk after the crash:")
    for name, committed in disk_listing(ckpt):
        tag = "[green]COMMIT[/]" if committed else "[yellow]no COMMIT: incomplete, ignored by restore[/]"
        con.print(f"  {name}  {tag}")

    # --- run 2: fresh model in this process, restore, finish ---------------------------------
    con.print("\n[bold]run 2[/]: fresh process state, new model/optimizer, restore, train to the end")
    state = build_state(args.steps)
    run2: dict[int, dict] = {}

    def emit2(ev: dict) -> None:
        if ev["ev"] == "step":
            run2[ev["step"]] = ev
            if "save_call_s" in ev:
                con.print(f"  step {ev['step']:3d}  loss {ev['loss']:.5f}  "
                          f"save({ev['step']}) returned after {ev['save_call_s'] * 1e3:.1f} ms")

    with CheckpointManager(ckpt, snapshot="async", **tier_kwargs()) as mgr:
        steps_before = mgr.steps()
        con.print(f"  mgr.steps()   -> {steps_before}")
        if remote_url:
            con.print(f"  mgr.tiers()   -> {mgr.tiers()}")
            con.print("                   (a step committed locally but not uploaded before the crash is uploaded now)")
        t0 = time.perf_counter()
        restored = mgr.restore(state)
        con.print(f"  mgr.restore() -> [bold]{restored}[/]  ({(time.perf_counter() - t0) * 1e3:.0f} ms, "
                  f"every chunk verified)")
        train(mgr, state, (restored or 0) + 1, args.steps, args.every, emit2)
        mgr.wait()  # every save durable on every tier
        stats2 = [s.as_dict() for s in mgr.stats()]
        steps_after = mgr.steps()
        tiers_after = mgr.tiers()
    con.print(f"  mgr.steps() at the end -> {steps_after}")
    if remote_url:
        con.print(f"\ntiers at the end (keep_local={KEEP_LOCAL}, keep_remote={KEEP_REMOTE}):")
        con.print(tier_table(tiers_after))

    # --- losses around the resume point -------------------------------------------------------
    r = restored or 0
    lt = Table(title=f"loss around the resume point (restored step {r})", title_justify="left")
    for c in ("step", "run 1 (crashed)", "run 2 (resumed)", "run2 - run1"):
        lt.add_column(c, justify="right")
    for s in range(max(1, r - 2), min(args.steps, max(r, args.kill_after) + 3) + 1):
        a, b = run1.get(s), run2.get(s)
        diff = "-" if a is None or b is None else f"{b['loss'] - a['loss']:+.2e}"
        lt.add_row(str(s), f"{a['loss']:.5f}" if a else "-", f"{b['loss']:.5f}" if b else "-", diff)
    con.print()
    con.print(lt)
    replayed = [s for s in run2 if s in run1]
    if replayed:
        worst = max(abs(run2[s]["loss"] - run1[s]["loss"]) for s in replayed)
        con.print(f"steps {min(replayed)}..{max(replayed)} were trained twice (lost in the crash, "
                  f"replayed after restore): max |loss difference| = {worst:.2e}")

    # --- stall table -------------------------------------------------------------------------
    metrics = read_metrics(ckpt)
    rows = [(1, m) for m in metrics[:n_metrics_run1]] + [(2, m) for m in metrics[n_metrics_run1:]]
    if not metrics:  # fall back on the in-memory stats of run 2
        rows = [(2, m) for m in stats2]
    st = Table(title="per-save timings (ms) from metrics.jsonl", title_justify="left",
               caption="stall: loop blocked (save() + guard before the next optimizer.step()); "
                       "the snapshot copy overlaps forward/backward", caption_justify="left")
    for c in ("run", "step", "wait_prev", "stall", "snapshot", "write", "commit", "total",
              "MB written", "MB/s") + (("upload",) if remote_url else ()):
        st.add_column(c, justify="right")
    for run, m in rows:
        ok = m.get("ok", True)
        st.add_row(str(run), str(m.get("step")) + ("" if ok else " [red]FAILED[/]"),
                   ms(num(m, "wait_prev_s")), ms(num(m, "stall_s")), ms(num(m, "snapshot_s")),
                   ms(num(m, "write_s")), ms(num(m, "commit_s")), ms(num(m, "total_s")),
                   f"{num(m, 'bytes_written') / 1e6:.1f}", rate(num(m, "write_bytes_per_s")),
                   *((ms(num(m, "upload_s")),) if remote_url else ()))
    lost = [s for s in run1 if "save_call_s" in run1[s] and
            not any(run == 1 and m.get("step") == s for run, m in rows)]
    con.print()
    con.print(st)
    if lost:
        con.print(f"run 1 save(s) {lost}: no metrics line (still in flight at the SIGKILL)")

    # --- summary -----------------------------------------------------------------------------
    stalls = [num(m, "stall_s") for _, m in rows if m.get("ok", True)]
    stalls = [s for s in stalls if not math.isnan(s)]
    step_s = [e["step_s"] for e in list(run1.values()) + list(run2.values())]
    med_stall = statistics.median(stalls) if stalls else float("nan")
    med_step = statistics.median(step_s)
    totals = [t for t in (num(m, "total_s") for _, m in rows if m.get("ok", True)) if not math.isnan(t)]  # recovered: unknown
    con.print()
    con.rule("[bold]summary")
    con.print(f"restored step            {restored}   (run 1 was killed after step {args.kill_after})")
    con.print(f"committed steps          {steps_before} after the crash, {steps_after} at the end")
    con.print(f"median stall per save    {med_stall * 1e3:.1f} ms   (training loop blocked)")
    if totals:
        con.print(f"median save to durable   {statistics.median(totals) * 1e3:.1f} ms   "
                  f"(overlapped with training)")
    con.print(f"median step time         {med_step * 1e3:.1f} ms")
    if not math.isnan(med_stall):
        con.print(f"stall / step             {med_stall / med_step:.1%} of one step; saving every "
                  f"{args.every} steps costs ~{med_stall / (args.every * med_step):.1%} of training time")
    uploads = [num(m, "upload_s") for _, m in rows if m.get("ok", True)]
    uploads = [u for u in uploads if not math.isnan(u)]
    if uploads:
        con.print(f"median commit to remote  {statistics.median(uploads) * 1e3:.1f} ms   (local commit -> durable on S3, "
                  f"in the background)")
    if remote_url:
        lost_node(con, ckpt, args, state)
    con.print(f"wall time                {time.perf_counter() - t_start:.1f} s")
    from rich.markup import escape

    cli = "checkpointing" if shutil.which("checkpointing") else f"{Path(sys.executable).name} -m checkpointing"
    tries = [(f"report {ckpt}", "what each save cost: stall, total, bytes, overhead")]
    if any(committed for _, committed in disk_listing(ckpt)):  # after a lost node, the steps are on the remote tier only
        tries += [(f"ls {ckpt}", "the steps kept, with their loss"), (f"verify {ckpt}", "re-read every chunk and check its digest")]
    if remote_url and args.remote != "embedded":
        tries += [(f"ls {ckpt} --remote {remote_url}", "where each step is durable"), (f"verify {remote_url}", "the remote copy")]
    con.print("\ntry it:")
    for command, what in tries:
        con.print(f"  {escape(cli)} {escape(command)}   [dim]# {what}[/]", soft_wrap=True)


def lost_node(con, ckpt: Path, args: argparse.Namespace, trained: dict) -> None:
    """The node dies with its disk: restore on a 'new machine' (an empty local directory) from S3 alone."""
    con.print()
    con.rule("[bold]lost node")
    history = (ckpt / "metrics.jsonl").read_bytes() if (ckpt / "metrics.jsonl").is_file() else b""
    shutil.rmtree(ckpt)
    con.print(f"deleted the local tier {ckpt} (the node and its NVMe are gone)")
    state = build_state(args.steps)
    with CheckpointManager(ckpt, snapshot="async", **tier_kwargs()) as mgr:
        con.print(f"  new manager, empty local directory: mgr.tiers() -> {mgr.tiers()}")
        t0 = time.perf_counter()
        restored = mgr.restore(state)
        dt = time.perf_counter() - t0
    same = all(torch.equal(a, b) for a, b in zip(trained["model"].state_dict().values(), state["model"].state_dict().values()))
    opt_same = all(torch.equal(a["exp_avg"], b["exp_avg"]) for a, b in
                   zip(trained["optim"].state_dict()["state"].values(), state["optim"].state_dict()["state"].values()))
    con.print(f"  mgr.restore() -> [bold]{restored}[/] from the remote tier in {dt * 1e3:.0f} ms; model "
              f"{'[green]identical[/]' if same else '[red]DIFFERENT[/]'} to the end of run 2, AdamW state "
              f"{'[green]identical[/]' if opt_same else '[red]DIFFERENT[/]'}")
    if not (same and opt_same):
        sys.exit("the state restored from the remote tier differs")
    if history:  # the save history is a log, not state: a job ships its logs off the node; the demo kept a copy
        newer = (ckpt / "metrics.jsonl").read_bytes() if (ckpt / "metrics.jsonl").is_file() else b""
        (ckpt / "metrics.jsonl").write_bytes(history + newer)
        con.print(f"  {ckpt / 'metrics.jsonl'}: the run's save history (a log, kept off the node) put back for the report")


# ----------------------------------------------------------------------------- --peers: two nodes with peer copies
def peer_child_main(args: argparse.Namespace) -> None:
    """One rank (one node) of the two-node job. 'train': train and save with a peer copy on the other node,
    keep a reference of the last saved state. 'peer' / 'remote': restore (with / without peer copies)."""
    import logging

    import torch.distributed as dist

    lines: list[str] = []

    class Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logging.getLogger("checkpointing").addHandler(Lines())
    logging.getLogger("checkpointing").setLevel(logging.INFO)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=2)
    state = build_state(args.steps, seed=args.rank)  # each node trains its own model (its own shard of the job)
    base, ref = Path(args.dir), Path(args.dir) / f"ref{args.rank}.pt"
    peers = 0 if args.peer_child == "remote" else 1
    with CheckpointManager(base / f"node{args.rank}", snapshot="async", peer_copies=peers, timeout_s=120, **tier_kwargs()) as mgr:
        if args.peer_child == "train":
            train(mgr, state, 1, args.steps, args.every, lambda ev: None)
            if args.steps % args.every:
                mgr.save(args.steps, state)
            mgr.wait()  # durable locally, on the peer node (and remotely)
            torch.save({"model": state["model"].state_dict(), "optim": state["optim"].state_dict()}, ref)
            print(json.dumps({"ev": "saved", "tiers": {str(k): v for k, v in mgr.tiers().items()}}), flush=True)
        else:
            t0 = time.perf_counter()
            step = mgr.restore(state)
            seconds = time.perf_counter() - t0
            saved = torch.load(ref)
            exact = _same(saved["model"], state["model"].state_dict()) and _same(saved["optim"]["state"], state["optim"].state_dict()["state"])
            said = [line for line in lines if "restored step" in line or "fetched back" in line]
            print(json.dumps({"ev": "restored", "step": step, "seconds": seconds, "exact": exact, "log": said}), flush=True)
    dist.destroy_process_group()


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _peer_job(args: argparse.Namespace, base: Path, phase: str) -> list[dict]:
    """Run both ranks of the two-node job for `phase`; each rank's JSON event."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cmd = [sys.executable, os.path.abspath(__file__), "--peer-child", phase, "--port", str(port), "--dir", str(base),
           "--steps", str(args.steps), "--every", str(args.every)] + (["--quick"] if args.quick else [])
    procs = [subprocess.Popen(cmd + ["--rank", str(r)], stdout=subprocess.PIPE, text=True) for r in (0, 1)]
    events = []
    for r, proc in enumerate(procs):
        out, _ = proc.communicate(timeout=600)
        if proc.returncode != 0:
            sys.exit(f"rank {r} of the {phase} job failed with status {proc.returncode}")
        events.append(json.loads([line for line in out.splitlines() if line.startswith("{")][-1]))
    return events


def run_peers(args: argparse.Namespace, con, base: Path, remote_url: str | None) -> None:
    """Two nodes save with peer copies; node 1's disk is lost; it restores from node 0's copy (and, with a
    remote tier, once more from object storage alone, for comparison)."""
    con.print(f"\n[bold]two nodes[/]: ranks 0 and 1 (gloo on 127.0.0.1), local tiers {base}/node0 and {base}/node1, "
              f"peer_copies=1: each node's committed steps are also committed on the other's disk")
    saved = _peer_job(args, base, "train")
    con.print("tiers after training (rank 0's view):")
    con.print(tier_table({int(k): v for k, v in saved[0]["tiers"].items()}))
    peers = sorted(p.name for p in (base / "node0" / "peers").iterdir())
    con.print(f"  {base}/node0/peers/ holds node 1's copy: {peers}")
    shutil.rmtree(base / "node1")
    con.print(f"\n[bold]lost node[/]: deleted {base}/node1 (the machine and its disk are gone); a fresh job restores")
    got = _peer_job(args, base, "peer")
    for r, ev in enumerate(got):
        con.print(f"  rank {r}: restored step {ev['step']} in {ev['seconds'] * 1e3:.0f} ms, "
                  f"{'[green]bit-exact[/]' if ev['exact'] else '[red]DIFFERENT[/]'}")
        for line in ev["log"]:
            con.print(f"    [dim]{line}[/]", soft_wrap=True)
    if not all(ev["exact"] for ev in got):
        sys.exit("a state restored after the lost node differs from what was saved")
    if remote_url:
        shutil.rmtree(base / "node1")
        con.print(f"\n[bold]lost again, without peer copies[/]: deleted {base}/node1; restore with peer_copies=0 (object storage only)")
        remote = _peer_job(args, base, "remote")
        con.print(f"  rank 1: restored step {remote[1]['step']} from the remote tier in {remote[1]['seconds'] * 1e3:.0f} ms, "
                  f"{'[green]bit-exact[/]' if remote[1]['exact'] else '[red]DIFFERENT[/]'}")
        ratio = got[1]["seconds"] / remote[1]["seconds"] if remote[1]["seconds"] > 0 else float("nan")
        con.print(f"  [bold]restore of the lost node from its peer: {got[1]['seconds'] * 1e3:.0f} ms, {ratio:.0%} of the "
                  f"{remote[1]['seconds'] * 1e3:.0f} ms from object storage[/]")


def wipe_nodes(path: Path) -> None:
    """--peers: remove a previous run's node directories (nothing else)."""
    if path.exists():
        names = {e.name for e in path.iterdir()}
        if not names <= {"node0", "node1", "ref0.pt", "ref1.pt"}:
            sys.exit(f"refusing to wipe {path}: it holds more than a previous --peers run (node0/, node1/)")
        shutil.rmtree(path)


if __name__ == "__main__":
    main()
