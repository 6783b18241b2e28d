#!/usr/bin/env python
"""Export throughput: `checkpointing export --format safetensors` (and `--format torch`) against DCP's
`dcp_to_torch_save` and against `safetensors.torch.save_file` of the same tensors already in memory.

    python bench/bench_interop.py                     # ~0.75 GB state; markdown to bench/out/interop.md
    python bench/bench_interop.py --out-root /dev/shm # outputs on tmpfs: the converters without the output disk
    python bench/bench_interop.py --gb 0.1 --repeat 1 # smoke test

The state (fp32 tensors of 32 MiB and a few small ones, a model's shape) is saved once with
CheckpointManager (one rank) and once with torch.distributed.checkpoint.save. Each mode then runs
in a fresh child process, so its peak memory (VmHWM) is its own, twice: "cold" with the source's
page cache dropped first (fsync + POSIX_FADV_DONTNEED: the checkpoint is read from disk, as after
training), then "warm" right after (the source in the page cache: what the converter itself costs,
digests and copies included). Modes:
- ours -> safetensors: export_safetensors (every chunk verified, one file; and 256 MB shards)
- ours -> torch.save: export_torch (every chunk verified, one file)
- DCP -> torch.save: dcp_to_torch_save (DCP's own converter: no digests, the whole state in memory)
- save_file (memory): safetensors.torch.save_file of tensors already in memory: the floor of
  writing the same bytes with the same library, no reading at all
Time is the call plus an fsync of what it wrote (no mode fsyncs by itself; without it the timings
measure the kernel's dirty-page throttling more than the converters), after a sync() of everything
earlier; GB/s is the state's bytes over it. "peak RSS" is the child's VmHWM growth during the (cold) call.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (HERE, ROOT):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import _common as C  # noqa: E402

_CHILD = r"""
import json, os, sys, time, warnings
warnings.filterwarnings("ignore")
import torch
torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
mode, src, out, spec = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])

def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

if mode == "save_file":
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(shape, generator=g) for name, shape in spec}
    call = lambda: save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
elif mode == "dcp_to_torch_save":
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    call = lambda: dcp_to_torch_save(src, os.path.join(out, "full.pt"))
elif mode == "export_torch":
    from checkpointing.interop import export_torch
    call = lambda: export_torch(src, os.path.join(out, "full.pt"), only="model")
else:
    from checkpointing.interop import export_safetensors
    shard = "5GB" if mode == "export_safetensors" else "256MB"
    call = lambda: export_safetensors(src, out, only="model", max_shard_size=shard)
def fsync_all(path):
    for name in os.listdir(path):
        fd = os.open(os.path.join(path, name), os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

before = hwm()
t0 = time.perf_counter()
call()
fsync_all(out)
seconds = time.perf_counter() - t0
print(json.dumps({"seconds": seconds, "peak_rss_growth": hwm() - before}))
"""

MODES = [
    ("export_safetensors", "ours -> safetensors (1 file, verified)", "ours"),
    ("export_safetensors_sharded", "ours -> safetensors (256 MB shards, verified)", "ours"),
    ("export_torch", "ours -> torch.save (verified)", "ours"),
    ("dcp_to_torch_save", "DCP -> torch.save (dcp_to_torch_save)", "dcp"),
    ("save_file", "safetensors save_file of in-memory tensors (floor)", None),
]


def spec_for(gb: float) -> list[tuple[str, list[int]]]:
    """Names and shapes: 32 MiB fp32 matrices, each layer with a small bias, plus an embedding."""
    n = max(1, int(gb * 1e9 / (32 << 20)))
    out: list[tuple[str, list[int]]] = [("embed.weight", [4096, 512])]
    for i in range(n):
        out += [(f"layers.{i}.weight", [2048, 4096]), (f"layers.{i}.bias", [2048])]
    return out


def make_sources(spec: list[tuple[str, list[int]]], root: str) -> int:
    import torch
    import torch.distributed.checkpoint as dcp

    from checkpointing import CheckpointManager

    g = torch.Generator().manual_seed(0)
    state = {name: torch.randn(shape, generator=g) for name, shape in spec}
    with CheckpointManager(os.path.join(root, "ours")) as mgr:
        mgr.save(1, {"model": state}).wait()
    dcp.save({"model": state}, checkpoint_id=os.path.join(root, "dcp"), no_dist=True)
    return sum(t.numel() * t.element_size() for t in state.values())


def run_mode(mode: str, src: str | None, out_root: str, spec: list, *, cold: bool, repeat: int) -> dict:
    """The median time and the largest peak-RSS growth of `repeat` runs of `mode`, each in a fresh child."""
    runs = [_run_once(mode, src, out_root, spec, cold=cold) for _ in range(repeat)]
    return {"seconds": statistics.median(r["seconds"] for r in runs), "peak_rss_growth": max(r["peak_rss_growth"] for r in runs),
            "all_seconds": [r["seconds"] for r in runs]}


def _run_once(mode: str, src: str | None, out_root: str, spec: list, *, cold: bool) -> dict:
    out = os.path.join(out_root, f"bench-interop-out-{mode}")
    os.makedirs(out, exist_ok=True)
    if src is not None and cold:
        C.evict(src)
    os.sync()  # no dirty pages of earlier work left for this mode's writes to wait behind
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _CHILD, mode, src or "", out, json.dumps(spec)],
                          capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{done.stderr[-3000:]}")
    shutil.rmtree(out, ignore_errors=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def markdown(rows: list[dict], nbytes: int, args: argparse.Namespace) -> str:
    lines = [
        f"# Export throughput ({datetime.date.today().isoformat()}, {platform.node() or 'host'}, "
        f"{os.cpu_count()} cores, torch {__import__('torch').__version__})",
        "",
        f"State: {nbytes / 1e9:.2f} GB of fp32 tensors (`{{'model': state}}`); median of {args.repeat} run(s) per cell"
        f"{'; outputs on ' + args.out_root if args.out_root else ''}. cold: the source's "
        "page cache dropped first (read from disk); warm: the source in the page cache. Times include an fsync of the "
        "output. peak RSS: the child's VmHWM growth during the call (cold run). `python bench/bench_interop.py"
        + (f" --gb {args.gb}" if args.gb != 0.75 else "") + (f" --repeat {args.repeat}" if args.repeat != 3 else "")
        + (f" --out-root {args.out_root}" if args.out_root else "") + "`",
        "",
        "| mode | cold s | cold GB/s | warm s | warm GB/s | peak RSS growth |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        cold, warm = r["cold"], r["warm"]
        lines.append(f"| {r['label']} | {cold['seconds']:.2f} | {nbytes / 1e9 / cold['seconds']:.2f} | {warm['seconds']:.2f} | "
                     f"{nbytes / 1e9 / warm['seconds']:.2f} | {cold['peak_rss_growth'] / 2**20:.0f} MiB |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=0.75, help="state size in GB (default 0.75)")
    ap.add_argument("--dir", default=None, help="working directory (default: a temporary one, removed)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per mode and column; the median time is shown (default 3)")
    ap.add_argument("--out-root", default=None, help="where the outputs are written (default: the working directory's disk)")
    ap.add_argument("--md", default=os.path.join(HERE, "out", "interop.md"), help="markdown output")
    args = ap.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="bench-interop-")
    try:
        spec = spec_for(args.gb)
        nbytes = make_sources(spec, root)
        rows = []
        for mode, label, source in MODES:
            src = None if source is None else os.path.join(root, source)
            cold = run_mode(mode, src, args.out_root or root, spec, cold=True, repeat=args.repeat)
            warm = run_mode(mode, src, args.out_root or root, spec, cold=False, repeat=args.repeat)
            rows.append({"mode": mode, "label": label, "cold": cold, "warm": warm})
            print(f"{label}: cold {cold['seconds']:.2f} s ({nbytes / 1e9 / cold['seconds']:.2f} GB/s), warm {warm['seconds']:.2f} s "
                  f"({nbytes / 1e9 / warm['seconds']:.2f} GB/s), peak RSS +{cold['peak_rss_growth'] / 2**20:.0f} MiB", flush=True)
        text = markdown(rows, nbytes, args)
        os.makedirs(os.path.dirname(args.md), exist_ok=True)
        with open(args.md, "w") as f:
            f.write(text)
        print(text)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
