"""What a save's disk I/O costs the CPUs when training keeps every one of them busy: the machine's
steal time (on a virtual machine, the host's CPU spent on the guest's I/O, taken from its virtual
CPUs) and the guest's system time, for writing a pack-sized file new, writing over one already
allocated, and deleting it (with online discard, the device frees its blocks then).

A torch loop (matmul + tanh, as many intra-op threads as cores) runs throughout; each operation
runs alone in its own window, with pauses between; /proc/stat gives steal and system time per
window, and the loop's iterations per second against the windows without I/O give what it lost.
`--idle` measures the same without the loop.

    python bench/bench_steal.py [--gb 0.7] [--dir DIR] [--reps 2] [--block-mib 32] [--idle]
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import threading
import time

import torch

_HZ = os.sysconf("SC_CLK_TCK")


def _stat() -> dict[str, float]:
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:9]
    return dict(zip(("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal"), (int(x) / _HZ for x in fields)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=0.7)
    p.add_argument("--dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"))
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--block-mib", type=int, default=32)
    p.add_argument("--idle", action="store_true", help="no training loop beside the I/O")
    P = p.parse_args(argv)
    os.makedirs(P.dir, exist_ok=True)
    n = int(P.gb * 1e9) // (1 << 20) * (1 << 20)
    block = P.block_mib << 20
    buf = mmap.mmap(-1, n)
    buf.madvise(mmap.MADV_HUGEPAGE)
    view = memoryview(buf)
    view[:] = os.urandom(1 << 20) * (n >> 20)
    path = os.path.join(P.dir, "steal-test.bin")

    stop, count = threading.Event(), [0]
    torch.set_num_threads(os.cpu_count() or 1)

    def loop() -> None:
        a = torch.randn(1024, 1024)
        while not stop.is_set():
            a = torch.tanh(a @ a)
            count[0] += 1

    def write(flags: int) -> None:
        fd = os.open(path, flags, 0o600)
        try:
            for off in range(0, n, block):
                os.pwrite(fd, view[off:off + block], off)
            os.fsync(fd)
        finally:
            os.close(fd)

    direct = getattr(os, "O_DIRECT", 0)
    ops = [
        ("nothing (1.5 s)", lambda: time.sleep(1.5)),
        ("O_DIRECT write, new file, + fsync", lambda: write(os.O_WRONLY | os.O_CREAT | os.O_EXCL | direct)),
        ("O_DIRECT write over that file, + fsync", lambda: write(os.O_WRONLY | direct)),
        ("delete it (unlink)", lambda: os.unlink(path)),
        ("buffered write, new file, + fsync", lambda: write(os.O_WRONLY | os.O_CREAT | os.O_EXCL)),
        ("delete it (unlink) ", lambda: os.unlink(path)),
    ]
    if os.path.exists(path):
        os.unlink(path)
    worker = None if P.idle else threading.Thread(target=loop, daemon=True)
    if worker is not None:
        worker.start()
        time.sleep(1.0)
    rows: dict[str, list[tuple[float, float, float, float]]] = {name: [] for name, _ in ops}
    try:
        for _ in range(P.reps):
            for name, op in ops:
                time.sleep(0.5)
                a, c0, t0 = _stat(), count[0], time.perf_counter()
                op()
                dt = time.perf_counter() - t0
                b, c1 = _stat(), count[0]
                rows[name].append((dt, b["steal"] - a["steal"], b["system"] + b["softirq"] - a["system"] - a["softirq"], (c1 - c0) / dt))
    finally:
        stop.set()
        if os.path.exists(path):
            os.unlink(path)
    base = statistics.median(r[3] for r in rows["nothing (1.5 s)"]) if worker is not None else 0.0
    with open("/proc/mounts") as f:
        mounts = [line.split() for line in f]
    fs = max((m for m in mounts if os.path.abspath(P.dir).startswith(m[1])), key=lambda m: len(m[1]), default=["?"] * 4)
    print(f"{n / 1e9:.2f} GB in {P.block_mib} MiB writes to {P.dir} ({fs[2]} on {fs[0]}, {fs[3]}); {os.cpu_count()} CPUs; "
          f"{'no loop' if P.idle else 'a torch loop on every CPU'}; {P.reps} repetitions (each value: per repetition)\n")
    print("| operation | wall s | machine steal, vCPU-s | guest system + softirq, CPU-s |" + ("" if P.idle else " loop speed vs no I/O |"))
    print("|---|---|---|---|" + ("" if P.idle else "---|"))
    for name, _ in ops:
        r = rows[name]
        cells = [", ".join(f"{x[i]:.2f}" for x in r) for i in range(3)]
        speed = "" if P.idle else " " + ", ".join(f"{x[3] / base:.2f}" for x in r) + " |"
        print(f"| {name.strip()} | {cells[0]} | {cells[1]} | {cells[2]} |{speed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
