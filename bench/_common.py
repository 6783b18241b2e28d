"""Shared helpers for the benchmarks: raw I/O floors, page-cache eviction, a torch-free writer child.

This module deliberately does not import torch: it is also run as a small child process
(``python bench/_common.py --writer-child ...``) by the writer experiment, which must not pay
torch's import or memory cost.
"""
from __future__ import annotations

import json
import mmap
import os
import select
import statistics
import subprocess
import sys
import time

BLOCK = 64 << 20  # 64 MiB I/O blocks
PAGE = mmap.PAGESIZE
now = time.perf_counter


def round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def aligned_buffer(size: int, fill: int | None = 0xA5) -> mmap.mmap:
    """Anonymous, page-aligned buffer (valid for O_DIRECT), pages touched so no fault cost later.
    Backed by transparent huge pages where the kernel allows, like the staging pool: a floor
    measured from scattered 4 KiB pages would be a slower, noisier floor than the pool's."""
    buf = mmap.mmap(-1, size)
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):
        pass
    if fill is not None:
        chunk = bytes([fill]) * (1 << 20)
        for off in range(0, size, len(chunk)):
            n = min(len(chunk), size - off)
            buf[off:off + n] = chunk[:n]
    return buf


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _files_under(path: str) -> list:
    if not os.path.isdir(path):
        return [path]
    out = []
    for root, _dirs, names in os.walk(path):
        out.extend(os.path.join(root, n) for n in names)
    return out


def evict(path: str) -> int:
    """Drop the page cache of a file, or of every file under a directory (fsync first, then
    POSIX_FADV_DONTNEED). Returns the number of files handled. Portable, no root needed."""
    files = _files_under(path)
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return len(files)


def resident_bytes(path: str) -> int | None:
    """Bytes of `path` (a file, or all files under a dir) present in the page cache (mincore)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    total = 0
    for f in _files_under(path):
        size = os.path.getsize(f)
        if size == 0:
            continue
        fd = os.open(f, os.O_RDONLY)
        try:
            p = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if p is None or p == ctypes.c_void_p(-1).value:
                return None
            vec = ctypes.create_string_buffer((size + PAGE - 1) // PAGE)
            rc = libc.mincore(ctypes.c_void_p(p), size, vec)
            libc.munmap(ctypes.c_void_p(p), size)
            if rc != 0:
                return None
            total += sum(b & 1 for b in vec.raw) * PAGE
        finally:
            os.close(fd)
    return total


# ---------------------------------------------------------------------------------------------
# raw sequential I/O (floors)
# ---------------------------------------------------------------------------------------------

def write_file(path: str, nbytes: int, buf, *, direct: bool, fsync: bool = True, fresh: bool = True) -> float:
    """Write `nbytes` (rounded up to the page size for O_DIRECT) to a fresh file in 64 MiB pwrite
    blocks taken from `buf` (a page-aligned buffer of >= min(nbytes, BLOCK) bytes), then fsync.
    The buffer is re-used for every block (its content is irrelevant to ext4). `fresh=False`:
    over the blocks of an existing file instead (no truncation). Returns seconds."""
    mv = memoryview(buf)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if fresh else 0)
    if direct:
        flags |= os.O_DIRECT
        nbytes = round_up(nbytes, PAGE)
    t0 = now()
    fd = os.open(path, flags, 0o644)
    try:
        off = 0
        while off < nbytes:
            n = min(BLOCK, nbytes - off, len(mv))
            w = os.pwrite(fd, mv[:n], off)
            off += w
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return now() - t0


def best_write(out: str, nbytes: int, buf, reps: int, *, direct: bool) -> tuple[str, float]:
    """The best of `reps` writes of `nbytes` from `buf` to a fresh out/floor.bin (+ fsync; the old
    file removed and the directory synced first). Returns (the file's path, left in place; seconds)."""
    path = os.path.join(out, "floor.bin")
    ts = []
    for _ in range(reps):
        if os.path.exists(path):
            os.remove(path)
        fsync_dir(out)
        ts.append(write_file(path, nbytes, buf, direct=direct))
    return path, min(ts)


def write_from(path: str, src, *, direct: bool) -> float:
    """Write all of the (page-aligned, page-multiple for O_DIRECT) buffer `src` to a fresh file in
    64 MiB blocks + fsync. Returns seconds."""
    mv = memoryview(src).cast("B")
    nbytes = len(mv)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    t0 = now()
    fd = os.open(path, flags, 0o644)
    try:
        off = 0
        while off < nbytes:
            n = min(BLOCK, nbytes - off)
            off += os.pwrite(fd, mv[off:off + n], off)
        os.fsync(fd)
    finally:
        os.close(fd)
    return now() - t0


def read_file(path: str, buf, *, direct: bool) -> tuple[float, int]:
    """Sequentially read a whole file in 64 MiB blocks into `buf` (page-aligned). Returns
    (seconds, bytes)."""
    mv = memoryview(buf)
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    t0 = now()
    fd = os.open(path, flags)
    total = 0
    try:
        while True:
            n = os.preadv(fd, [mv[:BLOCK]], total)
            if n <= 0:
                break
            total += n
            if n < BLOCK:
                # O_DIRECT: a short read is the end of file
                if direct:
                    break
    finally:
        os.close(fd)
    return now() - t0, total


def gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


_TCK = os.sysconf("SC_CLK_TCK")


def cpu_snapshot() -> tuple[float, float]:
    """(CPU-seconds busy on the whole machine, CPU-seconds used by this process and its children,
    live or reaped) since boot. The difference of deltas is CPU time taken by *other* processes:
    a direct measure of machine noise during a measurement."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    busy = (sum(v[:8]) - v[3] - v[4]) / _TCK  # all but idle and iowait (guest is inside user)
    t = os.times()
    own = t.user + t.system + t.children_user + t.children_system
    me = os.getpid()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                parts = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(parts[1]) == me:  # ppid
            own += sum(int(x) for x in parts[11:15]) / _TCK  # utime stime cutime cstime
    return busy, own


def foreign_cpu_since(snap: tuple[float, float]) -> float:
    b, o = cpu_snapshot()
    return max(0.0, (b - snap[0]) - (o - snap[1]))


def wait_quiet(max_wait_s: float, threshold: float = 0.3, window_s: float = 5.0, log=print) -> float:
    """Wait (up to max_wait_s) until other processes use < threshold CPUs over window_s.
    Returns the foreign CPU load (CPUs) of the last window."""
    t_end = time.time() + max_wait_s
    while True:
        s = cpu_snapshot()
        time.sleep(window_s)
        load = foreign_cpu_since(s) / window_s
        if load < threshold or time.time() >= t_end:
            return load
        log(f"machine busy: other processes use {load:.2f} CPUs; waiting ...")


def machine_description() -> dict:
    info = {"cpus": os.cpu_count()}
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return info


def machine_line(path: str) -> str:
    """'2 CPUs (AMD EPYC), 23.5 GiB, ext4 (/dev/vda)': the machine and the filesystem of `path`, for a table's caption."""
    m = machine_description()
    return f"{m.get('cpus')} CPUs ({m.get('cpu_model', '?')}), {m.get('mem_total_gib')} GiB, {fs_type(path)}"


def fs_type(path: str) -> str:
    path = os.path.realpath(path)
    best, fstype = "", "?"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and path.startswith(parts[1]) and len(parts[1]) > len(best):
                    best, fstype = parts[1], f"{parts[2]} ({parts[0]})"
    except OSError:
        pass
    return fstype


# ---------------------------------------------------------------------------------------------
# writer child (for the thread-vs-process writer experiment)
# ---------------------------------------------------------------------------------------------

def writer_loop(src, path: str, direct: bool, should_stop, times: list) -> None:
    """Write `src` to `path` (+fsync) again and again until should_stop() is true after a write."""
    while True:
        times.append(write_from(path, src, direct=direct))
        if should_stop():
            return


class WriterChild:
    """A torch-free child process that maps a /dev/shm file and writes it on command."""

    def __init__(self, shm_path: str, size: int):
        self.p = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--writer-child", shm_path, str(size)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
        )
        assert self.p.stdout.readline().strip() == "ready"

    def start(self, path: str, direct: bool) -> None:
        self.p.stdin.write(json.dumps({"cmd": "start", "path": path, "direct": direct}) + "\n")
        self.p.stdin.flush()
        assert self.p.stdout.readline().strip() == "started"

    def stop(self) -> list:
        self.p.stdin.write(json.dumps({"cmd": "stop"}) + "\n")
        self.p.stdin.flush()
        return json.loads(self.p.stdout.readline())

    def close(self) -> None:
        try:
            self.p.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
            self.p.stdin.flush()
        except (BrokenPipeError, OSError):
            pass
        self.p.wait(timeout=30)


def _writer_child_main(shm_path: str, size: int) -> None:
    fd = os.open(shm_path, os.O_RDWR)
    src = mmap.mmap(fd, size)
    os.close(fd)
    print("ready", flush=True)
    stdin = sys.stdin
    while True:
        line = stdin.readline()
        if not line:
            return
        msg = json.loads(line)
        if msg["cmd"] == "exit":
            return
        if msg["cmd"] != "start":
            continue
        print("started", flush=True)
        times: list = []
        state = {"stop": False}

        def should_stop():
            r, _, _ = select.select([stdin], [], [], 0)
            if r:
                m = json.loads(stdin.readline())
                state["stop"] = True
                assert m["cmd"] == "stop"
            return state["stop"]

        writer_loop(src, msg["path"], msg["direct"], should_stop, times)
        print(json.dumps(times), flush=True)


# ---------------------------------------------------------------------------------------------
# per-thread accounting from /proc (the cost harness, bench_cost.py)
# ---------------------------------------------------------------------------------------------

# one task's counters, all cumulative since the task started:
#   cpu_s: on-CPU time (schedstat, ns precision), wait_s: time runnable but waiting for a CPU
#   (run-queue delay), slices: times scheduled in, user_s / sys_s (stat, clock ticks),
#   minflt / majflt, vcsw / ivcsw (voluntary / involuntary context switches), wchar / rchar
#   (bytes passed to write/read syscalls), wbytes (bytes this task caused to be sent to storage)
TASK_FIELDS = ("cpu_s", "wait_s", "slices", "user_s", "sys_s", "minflt", "majflt", "vcsw", "ivcsw",
               "wchar", "rchar", "wbytes")


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def read_task(task_dir: str) -> dict | None:
    """Counters (TASK_FIELDS) of one task (/proc/PID/task/TID), or None if it is gone."""
    stat = _read(task_dir + "/stat")
    sched = _read(task_dir + "/schedstat")
    if stat is None or sched is None:
        return None
    f = stat.rsplit(")", 1)[1].split()
    run_ns, wait_ns, slices = (int(x) for x in sched.split()[:3])
    out = {"cpu_s": run_ns / 1e9, "wait_s": wait_ns / 1e9, "slices": slices,
           "user_s": int(f[11]) / _TCK, "sys_s": int(f[12]) / _TCK,
           "minflt": int(f[7]), "majflt": int(f[9]), "vcsw": 0, "ivcsw": 0, "wchar": 0, "rchar": 0, "wbytes": 0}
    status = _read(task_dir + "/status") or ""
    for line in status.splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            out["vcsw"] = int(line.split()[1])
        elif line.startswith("nonvoluntary_ctxt_switches:"):
            out["ivcsw"] = int(line.split()[1])
    io = _read(task_dir + "/io") or ""
    for line in io.splitlines():
        k, _, v = line.partition(":")
        if k == "wchar":
            out["wchar"] = int(v)
        elif k == "rchar":
            out["rchar"] = int(v)
        elif k == "write_bytes":
            out["wbytes"] = int(v)
    return out


def task_comm(pid: int, tid: int) -> str:
    return (_read(f"/proc/{pid}/task/{tid}/comm") or "?").strip()


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children, their children, ...), from a scan of /proc."""
    parent: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        stat = _read(f"/proc/{name}/stat")
        if stat is not None:
            parent[int(name)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out.extend(kids)
        frontier.extend(kids)
    return out


def machine_cpu() -> dict:
    """The machine's CPU-seconds since boot: busy (user+nice+system+irq+softirq) and steal
    (time the hypervisor ran something else while a vCPU wanted to run)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return {"busy_s": (v[0] + v[1] + v[2] + v[5] + v[6]) / _TCK, "steal_s": v[7] / _TCK,
            "iowait_s": v[4] / _TCK}


class TaskSampler:
    """Samples the counters of every thread of this process and of its descendant processes (summed
    per process), and the machine's CPU, so that deltas between two samples say who used the CPU,
    who waited for one, who faulted and who wrote, per thread. A sample costs ~0.1 ms per thread.
    Descendants are found again only on `refresh_children()` (a scan of /proc, a few ms)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.children: list[int] = []

    def refresh_children(self) -> None:
        self.children = descendants(self.pid)

    def sample(self) -> dict:
        tasks = {}
        base = f"/proc/{self.pid}/task"
        for name in os.listdir(base):
            c = read_task(f"{base}/{name}")
            if c is not None:
                tasks[int(name)] = c
        kids = {}
        for pid in self.children:
            tot = None
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for name in tids:
                c = read_task(f"/proc/{pid}/task/{name}")
                if c is None:
                    continue
                tot = c if tot is None else {k: tot[k] + c[k] for k in TASK_FIELDS}
            if tot is not None:
                kids[pid] = tot
        return {"t": now(), "machine": machine_cpu(), "tasks": tasks, "children": kids}


def task_delta(a: dict | None, b: dict) -> dict:
    """b - a per counter (a None: the task started after sample a, so b is its delta)."""
    return dict(b) if a is None else {k: b[k] - a[k] for k in TASK_FIELDS}


def write_results(res: dict, md: str, json_path: str, md_path: str | None) -> None:
    """A bench's results: JSON at `json_path`, markdown at `md_path` (if any) and on stdout."""
    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    with open(json_path, "w") as f:
        json.dump(res, f, indent=1, default=str)
    if md_path:
        with open(md_path, "w") as f:
            f.write(md + "\n")
    print(md)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--writer-child":
        _writer_child_main(sys.argv[2], int(sys.argv[3]))
    else:
        sys.exit("usage: _common.py --writer-child SHM_PATH SIZE")
