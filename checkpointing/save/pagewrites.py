"""Which pages of this process's memory were written since they were last looked at (Linux >= 6.7).

A userfaultfd registered in asynchronous write-protect mode (UFFD_FEATURE_WP_ASYNC) lets the kernel
resolve a write to a write-protected page by itself, without a handler thread: it drops the
protection and so records that the page was written. The PAGEMAP_SCAN ioctl on /proc/self/pagemap
reports, for a range, which pages are written, and protects them all again in the same walk. A
scan costs a page-table walk, not a read of the memory, and each page costs one minor fault the
first time it is written after a scan.

A page counts as unwritten only when the scan finds it present (or swapped out) and still
protected. Everything else counts as written: pages the scan does not report, pages dropped by
MADV_DONTNEED or munmap (their contents changed without a write), ranges whose mapping changed.
Only private anonymous memory is watched (the process heap and anonymous mmaps, where tensors
live): a shared or file-backed mapping can change through another mapping without a write here.
Writes that bypass the page tables (a device's DMA into long-term pinned pages: CUDA pinned host
memory, RDMA-registered buffers) are not seen; callers do not watch pinned tensors, and users with
such writers turn watching off (`change_detection="compare"`).

Where any of this is missing (older kernels, seccomp filters that forbid userfaultfd, other
architectures), `watcher()` returns None and callers compare bytes instead. The watcher checks
the kernel's behaviour on a scratch mapping before the first use.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import platform
import threading

log = logging.getLogger("checkpointing")

PAGE = mmap.PAGESIZE

_SYSCALL = {"x86_64": 323, "aarch64": 282}  # __NR_userfaultfd
_UFFD_USER_MODE_ONLY = 1
_UFFD_API = 0xAA
_FEATURE_WP_UNPOPULATED = 1 << 13  # needed for PAGEMAP_SCAN to protect anonymous memory
_FEATURE_WP_ASYNC = 1 << 15
_REGISTER_MODE_WP = 1 << 1
_SCAN_WP_MATCHING = 1 << 0  # protect what the scan reports
_SCAN_CHECK_WPASYNC = 1 << 1  # fail (EPERM) on memory not registered in async write-protect mode
_IS_WRITTEN, _IS_PRESENT, _IS_SWAPPED = 1 << 1, 1 << 3, 1 << 4
_VEC = 1024  # regions per ioctl


def _iowr(kind: int, nr: int, size: int) -> int:
    return (3 << 30) | (size << 16) | (kind << 8) | nr


class _Api(ctypes.Structure):
    _fields_ = [("api", ctypes.c_uint64), ("features", ctypes.c_uint64), ("ioctls", ctypes.c_uint64)]


class _Range(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Register(ctypes.Structure):
    _fields_ = [("range", _Range), ("mode", ctypes.c_uint64), ("ioctls", ctypes.c_uint64)]


class _ScanArg(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "size", "flags", "start", "end", "walk_end", "vec", "vec_len", "max_pages",
        "category_inverted", "category_mask", "category_anyof_mask", "return_mask")]


class _Region(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("end", ctypes.c_uint64), ("categories", ctypes.c_uint64)]


_UFFDIO_API = _iowr(0xAA, 0x3F, ctypes.sizeof(_Api))
_UFFDIO_REGISTER = _iowr(0xAA, 0x00, ctypes.sizeof(_Register))
_PAGEMAP_SCAN = _iowr(ord("f"), 16, ctypes.sizeof(_ScanArg))

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.ioctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p)
_libc.ioctl.restype = ctypes.c_int


def page_span(start: int, end: int) -> tuple[int, int]:
    """The whole pages holding bytes [start, end)."""
    return start // PAGE * PAGE, -(-end // PAGE) * PAGE


class PageWatcher:
    """This process's userfaultfd and pagemap. Use `watcher()`; thread-safe."""

    def __init__(self) -> None:
        number = _SYSCALL.get(platform.machine())
        if number is None:
            raise OSError(errno.ENOSYS, f"no userfaultfd syscall number known for {platform.machine()}")
        fd = _libc.syscall(number, os.O_CLOEXEC | os.O_NONBLOCK | _UFFD_USER_MODE_ONLY)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "userfaultfd")
        self._uffd = fd
        self._pagemap = -1
        try:
            api = _Api(_UFFD_API, _FEATURE_WP_ASYNC | _FEATURE_WP_UNPOPULATED, 0)
            self._ioctl(fd, _UFFDIO_API, api, "UFFDIO_API with asynchronous write-protect")
            self._pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        except BaseException:
            self.close()
            raise
        self.pid = os.getpid()
        self.seq = 0  # scans so far: a consumer's knowledge holds only while nobody else scanned
        self._lock = threading.Lock()
        self._vec = (_Region * _VEC)()

    def close(self) -> None:
        for fd in (self._uffd, self._pagemap):
            if fd >= 0:
                os.close(fd)
        self._uffd = self._pagemap = -1

    @staticmethod
    def _ioctl(fd: int, request: int, arg: ctypes.Structure, what: str) -> int:
        rc = _libc.ioctl(fd, request, ctypes.addressof(arg))
        if rc < 0:
            code = ctypes.get_errno()
            raise OSError(code, f"{what}: {os.strerror(code)}")
        return rc

    def scan(self, start: int, end: int) -> list[tuple[int, int]] | None:
        """Protect the pages of [start, end) (page-aligned) and return the spans of them written since
        their previous scan (pages never scanned count as written). None when the range cannot be
        watched (not private anonymous memory, or the kernel refused): treat all of it as written."""
        assert start % PAGE == 0 and end % PAGE == 0 and start < end
        with self._lock:
            self.seq += 1
            try:
                return self._scan(start, end)
            except OSError as exc:
                if exc.errno != errno.EPERM:  # EPERM: some page of the range is not registered yet
                    return self._refuse(start, end, exc)
            try:
                self._register(start, end)
                return self._scan(start, end)
            except OSError as exc:
                return self._refuse(start, end, exc)

    def peek(self, start: int, end: int) -> list[tuple[int, int]] | None:
        """The spans of [start, end) written since their previous scan, changing no protection (so it
        is not a scan: `seq` stays). None where the range is not watched, or the kernel refused."""
        assert start % PAGE == 0 and end % PAGE == 0 and start < end
        with self._lock:
            try:
                return self._scan(start, end, protect=False)
            except OSError as exc:
                return self._refuse(start, end, exc)

    @staticmethod
    def _refuse(start: int, end: int, exc: OSError) -> None:
        log.debug("write watch: %#x-%#x is compared instead (%s)", start, end, exc)
        return None

    def _scan(self, start: int, end: int, *, protect: bool = True) -> list[tuple[int, int]]:
        clean: list[tuple[int, int]] = []
        pos = start
        flags = (_SCAN_WP_MATCHING if protect else 0) | _SCAN_CHECK_WPASYNC
        while pos < end:
            arg = _ScanArg(ctypes.sizeof(_ScanArg), flags, pos, end, 0,
                           ctypes.addressof(self._vec), _VEC, 0, 0, 0, 0, _IS_WRITTEN | _IS_PRESENT | _IS_SWAPPED)
            n = self._ioctl(self._pagemap, _PAGEMAP_SCAN, arg, "PAGEMAP_SCAN")
            for k in range(n):
                r = self._vec[k]
                if not r.categories & _IS_WRITTEN and r.categories & (_IS_PRESENT | _IS_SWAPPED):
                    if clean and clean[-1][1] == r.start:
                        clean[-1] = (clean[-1][0], r.end)
                    else:
                        clean.append((r.start, r.end))
            if arg.walk_end <= pos:
                raise OSError(errno.EIO, f"PAGEMAP_SCAN made no progress at {pos:#x}")
            pos = arg.walk_end
        return complement(start, end, clean)

    def _register(self, start: int, end: int) -> None:
        """Register every mapping that holds part of [start, end), whole (so no mapping is split),
        if they cover it without a gap and all are private anonymous memory."""
        vmas = [v for v in _mappings() if v[0] < end and v[1] > start]
        pos = start
        for lo, hi, perms, path in vmas:
            if lo > pos:
                raise OSError(errno.EFAULT, f"{pos:#x}-{lo:#x} is not mapped")
            if perms[1] != "w" or perms[3] != "p" or not (path == "" or path == "[heap]" or path.startswith("[anon:")):
                raise OSError(errno.EINVAL, f"{lo:#x}-{hi:#x} is not private anonymous memory ({perms} {path!r})")
            pos = hi
        if pos < end:
            raise OSError(errno.EFAULT, f"{pos:#x}-{end:#x} is not mapped")
        for lo, hi, _, _ in vmas:
            self._ioctl(self._uffd, _UFFDIO_REGISTER, _Register(_Range(lo, hi - lo), _REGISTER_MODE_WP, 0), "UFFDIO_REGISTER")


def complement(start: int, end: int, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """[start, end) less the sorted, disjoint `spans`."""
    out: list[tuple[int, int]] = []
    pos = start
    for s, e in spans:
        s, e = min(max(s, start), end), min(e, end)
        if s > pos:
            out.append((pos, s))
        pos = max(pos, e)
    if pos < end:
        out.append((pos, end))
    return out


def _mappings() -> list[tuple[int, int, str, str]]:
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            out.append((lo, hi, parts[1], parts[5].strip() if len(parts) > 5 else ""))
    return out


def _self_test(w: PageWatcher) -> None:
    """Check on a scratch mapping that a write, and only a write, shows."""
    n = 4 * PAGE
    scratch = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = ctypes.c_char.from_buffer(scratch)
    try:
        start = ctypes.addressof(view)
        ctypes.memset(start, 1, n)
        seen = [w.scan(start, start + n)]
        ctypes.memset(start + 2 * PAGE + 5, 2, 1)
        seen += [w.scan(start, start + n), w.scan(start, start + n)]
    finally:
        del view
        scratch.close()
    expected = [[(start, start + n)], [(start + 2 * PAGE, start + 3 * PAGE)], []]
    if seen != expected:
        raise OSError(errno.EINVAL, f"the kernel reported written spans {seen}, expected {expected}")


_watcher: PageWatcher | None = None
_tried = False
_open_lock = threading.Lock()


def watcher() -> PageWatcher | None:
    """This process's watcher, or None where the kernel cannot watch writes (then compare bytes)."""
    global _watcher, _tried
    with _open_lock:
        if _watcher is not None and _watcher.pid != os.getpid():
            _watcher, _tried = None, False  # a forked child: the fds describe the parent
        if not _tried:
            _tried = True
            try:
                w = PageWatcher()
            except OSError as exc:
                log.debug("write watch unavailable, incremental saves compare bytes: %s", exc)
                return None
            try:
                _self_test(w)
            except OSError as exc:
                w.close()
                log.debug("write watch failed its self-test, incremental saves compare bytes: %s", exc)
                return None
            _watcher = w
        return _watcher
