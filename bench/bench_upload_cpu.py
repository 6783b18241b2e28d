#!/usr/bin/env python
"""What an upload to the remote tier costs this process's CPU, per GB and per thread.

    python bench/bench_upload_cpu.py                 # 0.5 GiB, 2 repetitions (~30 s on 2 cores)
    python bench/bench_upload_cpu.py --gib 1 --reps 3

One FsspecStorage on an S3 server (moto on 127.0.0.1 in a child process, examples/embedded_s3.py:
its CPU is another process's and is not counted) uploads a file of random bytes the way the
uploader sends a pack file (`upload_file`: part-sized preads, a multipart upload, parts in
parallel), and, for reference, plain s3fs `put_file` of the same file. Counted: the CPU time of
this process over the upload (getrusage), and per thread by name (/proc/self/task, the Python
names of our threads; fsspec's event loop thread is `fsspecIO`, the loop's executor `asyncio_N`).
The file is read from the page cache (written just before), so the disk is not in it.

On an http:// endpoint (this server) botocore signs every part's payload (SHA-256); over https
with a checksum, as on AWS, it does not, and TLS encrypts instead.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (ROOT, os.path.join(ROOT, "examples")):
    if p not in sys.path:
        sys.path.insert(0, p)

from checkpointing.storage import FsspecStorage  # noqa: E402

GiB = 1 << 30
TICK = os.sysconf("SC_CLK_TCK")


def thread_cpu() -> dict[int, tuple[str, float]]:
    """native thread id -> (name, CPU seconds) for every thread of this process."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = names.get(int(tid), f"thread-{tid}")
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / TICK)
    return out


def measure(fn) -> tuple[float, float, dict[str, float]]:
    """(wall s, process CPU s, CPU s by thread-name family) of fn()."""
    r0, b0, t0 = resource.getrusage(resource.RUSAGE_SELF), thread_cpu(), time.perf_counter()
    fn()
    wall = time.perf_counter() - t0
    r1, b1 = resource.getrusage(resource.RUSAGE_SELF), thread_cpu()
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    by: dict[str, float] = {}
    for tid, (name, c) in b1.items():
        family = name.rstrip("0123456789").rstrip("_-") or name
        by[family] = by.get(family, 0.0) + c - b0.get(tid, (name, 0.0))[1]
    return wall, cpu, {k: v for k, v in sorted(by.items(), key=lambda kv: -kv[1]) if v >= 0.01}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=0.5)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    from embedded_s3 import EmbeddedS3

    n = int(args.gib * GiB)
    with EmbeddedS3() as s3, tempfile.TemporaryDirectory(dir=os.path.join(HERE, "out") if os.path.isdir(os.path.join(HERE, "out")) else None) as tmp:
        url = s3.bucket("bench-upload-cpu")
        storage = FsspecStorage(url + "/ck", s3.storage_options)
        path = os.path.join(tmp, "data.bin")
        with open(path, "wb") as f:
            for _ in range(0, n, 64 << 20):
                f.write(os.urandom(min(64 << 20, n - f.tell())))
        storage.put("warm-up", b"x")  # the client, its session and credentials: not part of an upload
        rows = []
        for rep in range(args.reps):
            wall, cpu, by = measure(lambda: storage.upload_file(path, f"ours-{rep}.pack", n))
            rows.append(("ours: FsspecStorage.upload_file", wall, cpu, by))
            wall, cpu, by = measure(lambda: storage.fs.put_file(path, storage.endpoint.full(f"s3fs-{rep}.pack")))
            rows.append(("plain s3fs put_file", wall, cpu, by))
        storage.close()
    print(f"### Upload CPU, {n / GiB:.2f} GiB per upload, {args.reps} repetitions\n")
    print("| upload | wall s | MB/s | this process CPU s | CPU s per GB | by thread |")
    print("|---|---:|---:|---:|---:|---|")
    for name, wall, cpu, by in rows:
        threads = ", ".join(f"{k} {v:.2f}" for k, v in by.items())
        print(f"| {name} | {wall:.2f} | {n / wall / 1e6:.0f} | {cpu:.2f} | {cpu / (n / 1e9):.2f} | {threads} |")


if __name__ == "__main__":
    main()
