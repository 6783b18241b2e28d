"""Multi-rank test harness: real processes on gloo over 127.0.0.1, and the workers they run.

`run_ranks(worker, world, *args)` spawns `world` processes, each joins a fresh process group and
calls `worker(rank, world, *args)`; it returns the workers' results by rank, or raises with every
rank's traceback. A rank that exits without reporting (SIGKILL) yields `DIED`. Workers are
module-level functions here so the spawned interpreters can import them.
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

DIED = "<died>"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(n: int, script: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run` with n processes on 127.0.0.1. free_port() only finds a port
    that was free a moment ago: when the launcher's store cannot listen there (EADDRINUSE: another
    socket took it meanwhile, before any rank started), launch again on another port, twice at most."""
    for attempt in range(3):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(n),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), script, *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if proc.returncode == 0 or "EADDRINUSE" not in proc.stderr or attempt == 2:
            return proc
    raise AssertionError("unreachable")


def _child(rank: int, world: int, port: int, worker: Callable, args: tuple, out: str) -> None:
    torch.set_num_threads(1)
    result: Any
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        result = ("ok", worker(rank, world, *args))
    except BaseException as exc:  # noqa: BLE001 - the parent reports every rank's failure
        result = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
    os._exit(0)  # never hang in process-group teardown when a peer is gone


def run_ranks(worker: Callable, world: int, *args: Any, tmp: Path, timeout: float = 240.0, allow_died: bool = False) -> list[Any]:
    out = Path(tmp) / f"results-{time.monotonic_ns()}"
    out.mkdir(parents=True)
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, world, port, worker, args, str(out)), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    results, errors = [], []
    for r in range(world):
        path = out / f"rank{r}.pkl"
        if not path.exists():
            if r in hung:
                errors.append(f"rank {r} hung (killed after {timeout:.0f} s)")
            elif not allow_died:
                errors.append(f"rank {r} died without a result (exit code {procs[r].exitcode})")
            results.append(DIED)
            continue
        status, value = pickle.loads(path.read_bytes())
        if status == "error":
            errors.append(f"rank {r} raised {value}")
        results.append(value)
    if errors:
        raise AssertionError("\n\n".join(errors))
    return results


# ----------------------------------------------------------------------------- a small model


class Net(nn.Module):
    """Embedding, two pre-LN MLP blocks, a head: every kind of parameter FSDP2 shards."""

    def __init__(self, vocab: int = 37, d: int = 24) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.GELU(), nn.Linear(3 * d, d)) for _ in range(2))
        self.head = nn.Linear(d, vocab)
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = h + block(h)
        self.seen += x.numel()
        return self.head(h)


def build(world: int, *, sharded: bool = True, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model (FSDP2-sharded over all ranks when `sharded`) and its AdamW."""
    torch.manual_seed(seed)
    model = Net()
    if sharded:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, *, rank: int, start: int = 0) -> float:
    loss = torch.zeros(())
    for i in range(start, start + steps):
        g = torch.Generator().manual_seed(1000 * rank + i)
        x = torch.randint(0, 37, (4, 8), generator=g)
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), torch.roll(x, 1, 1).flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return float(loss.detach())


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of model and optimizer, unsharded, keyed by parameter name (comparable across world sizes)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    out = {}
    for k, v in msd.items():
        out[f"model/{k}"] = _full(v)
    for fqn, st in osd["state"].items():
        for name, v in st.items():
            out[f"optim/{fqn}/{name}"] = _full(v)
    return out


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b), (sorted(set(a) ^ set(b)))
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), f"{k} differs"


# ----------------------------------------------------------------------------- workers


def save_and_reference(rank: int, world: int, directory: str, ref_path: str, sharded: bool = True) -> dict[str, Any]:
    """Train 3 steps, save step 3 (model, AdamW, per-rank loader, replicated values), return what was saved."""
    from checkpointing import CheckpointManager

    model, opt = build(world, sharded=sharded)
    train(model, opt, 3, rank=rank)
    ref = full_state(model, opt)
    if rank == 0:
        torch.save(ref, ref_path)
    with CheckpointManager(directory, timeout_s=60) as mgr:
        stats = mgr.save(3, {"model": model, "optim": opt, "loader": {"pos": 100 + rank}, "cfg": {"lr": 0.01, "world": world}}).wait()
    return {"bytes_written": stats.bytes_written, "commit_s": stats.commit_s, "bytes_total": stats.bytes_total}


def restore_matrix(rank: int, world: int, directories: list[str], refs: list[str]) -> list[int]:
    """Restore each saved run into a fresh FSDP2 model and AdamW on this world size; compare bit-exactly."""
    from checkpointing import CheckpointManager

    steps = []
    for directory, ref_path in zip(directories, refs):
        model, opt = build(world, seed=123)
        cfg: dict[str, Any] = {}
        with CheckpointManager(directory, timeout_s=60) as mgr:
            steps.append(mgr.restore({"model": model, "optim": opt, "cfg": cfg}, strict=False))
        assert cfg["lr"] == 0.01
        assert_same(torch.load(ref_path), full_state(model, opt))
        train(model, opt, 1, rank=rank, start=3)  # the restored optimizer works
    return steps


def restore_plain(rank: int, world: int, directories: list[str], refs: list[str]) -> list[int]:
    """Restore sharded checkpoints into an unsharded model (one process, no FSDP): the full tensors."""
    from checkpointing import CheckpointManager

    steps = []
    for directory, ref_path in zip(directories, refs):
        model, opt = build(world, sharded=False, seed=123)
        with CheckpointManager(directory) as mgr:
            steps.append(mgr.restore({"model": model, "optim": opt}, strict=False))
        assert_same(torch.load(ref_path), full_state(model, opt))
    return steps


def dcp_helpers_roundtrip(rank: int, world: int, directory: str) -> bool:
    """The state_dict helpers of torch.distributed.checkpoint as the saved and restored objects."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from checkpointing import CheckpointManager

    model, opt = build(world)
    train(model, opt, 2, rank=rank)
    msd, osd = get_state_dict(model, opt)
    ref = full_state(model, opt)
    with CheckpointManager(directory, timeout_s=60) as mgr:
        mgr.save(2, {"model": msd, "optim": osd}).wait()
    model2, opt2 = build(world, seed=9)
    msd2, osd2 = get_state_dict(model2, opt2)
    with CheckpointManager(directory, timeout_s=60) as mgr:
        assert mgr.restore({"model": msd2, "optim": osd2}) == 2
    set_state_dict(model2, opt2, model_state_dict=msd2, optim_state_dict=osd2)
    assert_same(ref, full_state(model2, opt2))
    return True


def per_rank_state(rank: int, world: int, directory: str, phase: str) -> Any:
    """Per-rank values come back per rank at the same world size; at another one they are refused by name."""
    from checkpointing import CheckpointManager, CheckpointMismatchError

    with CheckpointManager(directory, timeout_s=60) as mgr:
        if phase.startswith("save"):
            state = {"loader": {"pos": 10 * rank, "seed": 7}, "rng": torch.full((3,), float(rank)), "shared": torch.arange(4)}
            if phase == "save-sharded":  # and an FSDP-style DTensor: each rank one half of the rows
                from torch.distributed.device_mesh import init_device_mesh
                from torch.distributed.tensor import Shard, distribute_tensor

                state["sharded"] = distribute_tensor(torch.arange(12.0).reshape(6, 2), init_device_mesh("cpu", (world,)), [Shard(0)])
            mgr.save(1, state).wait()
            return None
        loader = {"pos": -1, "seed": -1}
        state = {"loader": loader, "rng": torch.zeros(3), "shared": torch.zeros(4, dtype=torch.int64)}
        if phase == "same":
            assert mgr.restore(state) == 1
            return loader["pos"], state["rng"].tolist(), state["shared"].tolist()
        try:
            mgr.restore(state)
        except CheckpointMismatchError as exc:
            return str(exc)
        return "restored"


def fail_on_one_rank(rank: int, world: int, directory: str, bad_rank: int) -> str:
    """A real write failure (RLIMIT_FSIZE) on one rank: no commit anywhere, every rank names it."""
    import resource
    import signal

    from checkpointing import CheckpointManager, CheckpointSaveError

    x = torch.randn(1 << 18) + rank  # 1 MiB per rank
    with CheckpointManager(directory, timeout_s=60, direct_io=False) as mgr:
        mgr.save(1, {"x": x}).wait()
        if rank == bad_rank:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.RLIM_INFINITY))
        h = mgr.save(2, {"x": x + 1})
        try:
            h.wait()
        except CheckpointSaveError as exc:
            message = str(exc)
        else:
            message = "committed"
        if rank == bad_rank:
            resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        assert mgr.steps() == [1], mgr.steps()
        restored = {"x": torch.zeros_like(x)}
        assert mgr.restore(restored) == 1 and torch.equal(restored["x"], x)
        mgr.save(3, {"x": x + 3}).wait()  # the next save works
        assert mgr.latest_step() == 3
    return message


def killed_mid_save(rank: int, world: int, directory: str, victim: int) -> str:
    """The victim is SIGKILLed while the others save step 2; they must time out, not hang."""
    import signal

    from checkpointing import CheckpointError, CheckpointManager

    mgr = CheckpointManager(directory, timeout_s=5)
    mgr.save(1, {"x": torch.full((1 << 20,), rank + 1.0)}).wait()
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    mgr.save(2, {"x": torch.full((1 << 20,), rank + 2.0)})
    t0 = time.monotonic()
    try:
        mgr.wait()
    except CheckpointError as exc:
        return f"{time.monotonic() - t0:.1f}s {exc}"
    finally:
        mgr.close()  # leaves once the others are done with the store (or after timeout_s without the dead one)
    return "committed"


def restore_latest(rank: int, world: int, directory: str) -> tuple[int | None, float]:
    from checkpointing import CheckpointManager

    x = {"x": torch.zeros(1 << 20)}
    with CheckpointManager(directory, timeout_s=30) as mgr:
        step = mgr.restore(x)
    return step, float(x["x"][0])


def node_local_save(rank: int, world: int, base: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Each rank on its own 'node' (its own local_dir); replicated tensors are written once per node.
    Also: the (stored, decompressed) sizes of the manifests this rank fetched from rank 0's store."""
    import zlib

    import checkpointing.dist.store_coordinator as coordinator
    from checkpointing import CheckpointManager

    fetched = []

    class _Zlib:
        compress = staticmethod(zlib.compress)

        @staticmethod
        def decompress(data):
            out = zlib.decompress(data)
            fetched.append((len(data), len(out)))
            return out

    coordinator.zlib = _Zlib
    model, opt = build(world)
    train(model, opt, 1, rank=rank)
    replicated = torch.arange(1 << 16, dtype=torch.float32)
    with CheckpointManager(f"{base}/node{rank}", timeout_s=60) as mgr:
        mgr.save(1, {"model": model, "optim": opt, "table": replicated}).wait()
        return mgr.steps(), fetched


def node_local_restore(rank: int, world: int, base: str) -> str:
    from checkpointing import CheckpointError, CheckpointManager

    model, opt = build(world, seed=5)
    with CheckpointManager(f"{base}/node{rank}", timeout_s=60) as mgr:
        try:
            return f"restored {mgr.restore({'model': model, 'optim': opt, 'table': torch.zeros(1 << 16)})}"
        except CheckpointError as exc:
            return f"error: {exc}"


def commit_timing(rank: int, world: int, directory: str, saves: int) -> list[float]:
    """Commit time (report, merge, COMMIT on every tier) of a small sharded state."""
    from checkpointing import CheckpointManager

    model, opt = build(world)
    train(model, opt, 1, rank=rank)
    out = []
    with CheckpointManager(directory, timeout_s=120, keep_local=1) as mgr:
        for step in range(saves):
            out.append(mgr.save(step, {"model": model, "optim": opt}).wait().commit_s)
    return out


def failing_saves(rank: int, world: int, directory: str, plans: list[dict[int, str]]) -> list[tuple[str, list[str]]]:
    """Step 1 commits; then one save per plan, where rank r fails as plans[i].get(r) says: "fsize" (a
    real write failure, RLIMIT_FSIZE), "state" (a value that cannot be checkpointed: save() raises),
    or not at all. Per plan: the text of the error this rank got, and the errors its manager logged."""
    import logging
    import resource
    import signal

    from checkpointing import CheckpointError, CheckpointManager

    class Keep(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.ERROR)
            self.lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(record.getMessage())

    kept = Keep()
    logging.getLogger("checkpointing").addHandler(kept)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    x = torch.randn(1 << 18) + rank  # 1 MiB, different on every rank: after step 1 each rank writes its own
    out = []
    with CheckpointManager(directory, timeout_s=60, direct_io=False) as mgr:
        mgr.save(1, {"x": x}).wait()
        for step, plan in enumerate(plans, start=2):
            kept.lines.clear()
            fault = plan.get(rank)
            state: dict[str, Any] = {"x": x + step}
            if fault == "state":
                state["bad"] = object()
            if fault == "fsize":
                resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.RLIM_INFINITY))
            try:
                mgr.save(step, state).wait()
                message = "committed"
            except CheckpointError as exc:
                message = f"{type(exc).__name__}: {exc}"
            finally:
                resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
            try:
                mgr.wait()  # the background part of a save that failed inside save() is over (and logged)
            except CheckpointError:
                pass
            out.append((message, list(kept.lines)))
        assert mgr.steps() == [1], mgr.steps()
    logging.getLogger("checkpointing").removeHandler(kept)
    return out


def manifest_decodes(rank: int, world: int, directory: str, saves: int) -> dict[str, Any]:
    """Save a training FSDP2 model `saves` times (one shared directory: rank 0 leads the only local
    tier) and count, per rank, the manifests decoded while saving: every module of the package that
    imported decode_manifest gets a counting wrapper around the real one (a spy; it changes nothing)."""
    import checkpointing.format.decode as decode
    from checkpointing import CheckpointManager

    import checkpointing.dist.store_coordinator as store_coordinator

    model, opt = build(world)
    train(model, opt, 1, rank=rank)
    real, decoded = decode.decode_manifest, [0]
    accounts: list[Any] = []
    real_account = store_coordinator.decode_committed_step

    def account(*args: Any, **kwargs: Any) -> Any:
        accounts.append(real_account(*args, **kwargs))
        return accounts[-1]

    def counting(*args: Any, **kwargs: Any) -> Any:
        decoded[0] += 1
        return real(*args, **kwargs)

    written = []
    with CheckpointManager(directory, timeout_s=60, keep_local=2) as mgr:
        mgr.save(0, {"model": model, "optim": opt}).wait()  # every module the save path uses is imported now
        for module in [m for name, m in list(sys.modules.items()) if name.startswith("checkpointing")]:
            if getattr(module, "decode_manifest", None) is real:
                module.decode_manifest = counting
        store_coordinator.decode_committed_step = account
        try:
            for step in range(1, saves + 1):
                if step % 2:
                    train(model, opt, 1, rank=rank, start=step)
                written.append(mgr.save(step, {"model": model, "optim": opt}).wait().bytes_written)  # even steps: nothing changed
        finally:
            store_coordinator.decode_committed_step = real_account
            for module in [m for name, m in list(sys.modules.items()) if name.startswith("checkpointing")]:
                if getattr(module, "decode_manifest", None) is counting:
                    module.decode_manifest = real
    fresh, fresh_opt = build(world, seed=123)
    with CheckpointManager(directory, timeout_s=60) as mgr:
        restored = mgr.restore({"model": fresh, "optim": fresh_opt})
    assert_same(full_state(model, opt), full_state(fresh, fresh_opt))
    return {"decoded": decoded[0], "bytes_written": written, "restored": restored,
            "accounts": [(a.step, a.world_size, sorted({f.rank for f in a.files}), len(a.files)) for a in accounts]}


def different_steps(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Step 1 commits; then rank 0 saves step 2 while the others save step 3 (a rank that counts its steps otherwise);
    then every rank saves step 4. The error each rank got for the mismatched save, and the committed steps."""
    from checkpointing import CheckpointError, CheckpointManager

    x = torch.randn(1 << 12) + rank
    with CheckpointManager(directory, timeout_s=60, direct_io=False) as mgr:
        mgr.save(1, {"x": x}).wait()
        try:
            mgr.save(2 if rank == 0 else 3, {"x": x + 1}).wait()
            error = None
        except CheckpointError as exc:
            error = str(exc)
        mgr.save(4, {"x": x + 4}).wait()
        restored = {"x": torch.zeros_like(x)}
        step = mgr.restore(restored)
        return {"error": error, "steps": mgr.steps(), "restored": step, "same": bool(torch.equal(restored["x"], x + 4))}
