"""The staging pool: page-aligned host memory allocated once and reused across saves.

CPU tensors are copied with a single-threaded memmove that releases the GIL (it must not compete
with the training step's intra-op threads). CUDA tensors are copied with non-blocking copies on a
side stream into pinned memory; an event per chunk orders the writer after the copy.

For an incremental save (reuse.py) a CPU chunk is first compared with what the pool already holds
there (the previous save's bytes): a memcmp that releases the GIL and stops at the first
difference, so an unchanged chunk costs a read instead of a copy and a changed one costs a copy.
Where the kernel reports written pages, chunks not written since the previous save are not even
read (writewatch.py); `Copier.watchable` names the sources that can be watched.

What is copied after save() returned (snapshot="async") may have been freed by the user meanwhile
(a storage resized to 0): each source is checked before each chunk and after it, against its size
and its address at save(), and the save is refused. Only a free that unmaps the pages while a
memmove of them runs (a window of one chunk) is not caught: reading such memory safely
(process_vm_writev, which reports an unmapped page) cost 1.2-1.6x the copy's CPU, measured, for a
contract the user breaks (handle.wait_staged() says when the memory may go).

The pool is backed by transparent huge pages where the kernel allows (MADV_HUGEPAGE): 2 MiB
physically contiguous pieces make O_DIRECT writes from it about 1.6x faster than from 4 KiB pages
scattered over physical memory, and steadier, since the speed no longer depends on how fragmented
memory was when the pool was allocated (docs/benchmarks.md, "Staging pool pages").
"""

from __future__ import annotations

import ctypes
import mmap
from typing import Any, Callable

import torch

from checkpointing.errors import StateError
from checkpointing.save.writewatch import WriteWatch

_libc = ctypes.CDLL(None)
_memcmp = _libc.memcmp
_memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_memcmp.restype = ctypes.c_int

_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14
_madvise = _libc.madvise  # through ctypes, which lets go of the GIL: mmap.madvise holds it for the whole call
_madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_madvise.restype = ctypes.c_int


def _populate(buf: mmap.mmap, size: int) -> bool:
    """Fault every page of `buf` in now (MADV_POPULATE_WRITE), without holding the GIL: a pool of
    gigabytes takes a good part of a second to fault in, and the training thread runs meanwhile.
    False where the kernel does not know the advice."""
    anchor = ctypes.c_char.from_buffer(buf)
    address = ctypes.addressof(anchor)
    del anchor  # the buffer export ends here, so the pool can be closed later
    return _madvise(address, size, _MADV_POPULATE_WRITE) == 0


def map_staging(nbytes: int) -> mmap.mmap:
    """Private anonymous memory of `nbytes`, asked to be backed by transparent huge pages and
    faulted in now, once, rather than inside the first copy. The size is not rounded up to huge
    pages (a staging budget is a limit): the huge pages are the aligned 2 MiB ranges inside it.
    Where the kernel refuses either advice the memory is still valid, in 4 KiB pages."""
    size = max(nbytes, 1)
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)  # before the first fault: faults then take huge pages
    except (AttributeError, OSError):
        pass
    if not _populate(buf, size):  # kernel < 5.14: touch every page instead
        view = memoryview(buf)
        view[:: mmap.PAGESIZE] = bytes(len(range(0, size, mmap.PAGESIZE)))
        view.release()
    return buf


class StagingPool:
    """A byte buffer of `capacity` bytes: allocated anew when a plan needs more, or at most half of it (a state that
    shrank gives the memory back; one that varies a little keeps its pool, and what the pool holds for the next compare)."""

    def __init__(self) -> None:
        self.capacity = 0
        self.pinned = False
        self.allocations = 0
        self._mmap: mmap.mmap | None = None
        self._tensor: torch.Tensor | None = None
        self.view: memoryview = memoryview(b"")
        self.address = 0
        self.watch = WriteWatch()  # which sources were written since this pool last staged them

    def ensure(self, nbytes: int, *, pinned: bool) -> None:
        if pinned == self.pinned and (nbytes == self.capacity or self.capacity // 2 < nbytes <= self.capacity):
            return
        self.release()
        try:
            self._mmap = map_staging(nbytes)
        except (OSError, MemoryError) as exc:
            raise MemoryError(f"the staging pool cannot allocate {nbytes / 2**30:.2f} GiB of host memory ({exc}): a save stages "
                              "the whole state once; pass CheckpointManager(staging_budget_bytes=...) to stage it in a smaller "
                              "ring, or free host memory") from None
        self.view = memoryview(self._mmap)
        self._tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self.address = self._tensor.data_ptr()
        if pinned:
            err = torch.cuda.cudart().cudaHostRegister(self.address, nbytes, 0)
            if int(err) != 0:
                self.release()
                raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {int(err)}")
        self.capacity = nbytes
        self.pinned = pinned
        self.allocations += 1

    def tensor(self, offset: int, length: int) -> torch.Tensor:
        assert self._tensor is not None
        return self._tensor[offset : offset + length]

    def release(self) -> None:
        if self._mmap is None:
            return
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.address)
        self._tensor = None
        self.view.release()
        self.view = memoryview(b"")
        try:
            self._mmap.close()
        except BufferError:  # a view is still exported (a reader kept one); the GC will free it
            pass
        self._mmap = None
        self.capacity = 0
        self.address = 0


class Copier:
    """Copies byte ranges of source tensors into the pool; `ready(i)` blocks until copy i landed."""

    def __init__(self, pool: StagingPool, sources: list[torch.Tensor], start_event: Any = None,
                 versions: list[tuple[str, int, Callable[[], int]]] | None = None, addresses: list[int] | None = None) -> None:
        self.pool = pool
        self.originals = sources
        self.versions = versions  # per source: (key, version counter at save() or -1: not checked, the counter now)
        self.addresses = addresses  # per source: its data_ptr() at save(), or 0: not checked
        self.sources = [_flat_bytes(t) for t in sources]
        # per source: its live bytes' address range where writes to them can be watched (pagewrites.py):
        # CPU memory the tensor itself owns (not a contiguous copy), not pinned (a device may write
        # pinned pages by DMA, which no page table sees)
        pinned = torch.cuda.is_available()
        self.watchable = [
            (f.data_ptr(), f.data_ptr() + f.numel())
            if f.numel() and not t.is_cuda and f.data_ptr() == t.data_ptr() and not (pinned and t.is_pinned()) else None
            for t, f in zip(sources, self.sources)
        ]
        self.events: dict[int, Any] = {}
        self.stream = None
        devices = {t.device for t in sources if t.is_cuda}
        if devices:
            self.stream = torch.cuda.Stream(device=min(devices, key=str))
            if start_event is not None:
                self.stream.wait_event(start_event)

    def copy(self, i: int, leaf: int, src_offset: int, pool_offset: int, length: int, *, compare: bool = False,
             pieces: list[tuple[int, int]] | None = None, returned: bool = False) -> bool:
        """Copy chunk i into the pool. With `compare`, a CPU chunk whose bytes the pool already holds
        at `pool_offset` is left alone: returns True then (the bytes are the same), else False.
        `pieces` ((offset in the chunk, length)): only these can differ, so only these are compared.
        `returned`: save() has returned, so the user may have freed the source meanwhile: checked again once read."""
        src = self.sources[leaf]
        if src.is_cuda:
            with torch.cuda.stream(self.stream):
                self.pool.tensor(pool_offset, length).copy_(src[src_offset : src_offset + length], non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
            self.events[i] = event
            return False
        self._check_alive(leaf, src_offset + length)
        dst, from_ = self.pool.address + pool_offset, src.data_ptr() + src_offset
        same = compare and all(_memcmp(dst + o, from_ + o, n) == 0 for o, n in (pieces if pieces is not None else [(0, length)]))
        if not same:
            ctypes.memmove(dst, from_, length)
        if returned:  # freed (and the memory given to another) while it was read: what was read is not the state
            self._check_alive(leaf, src_offset + length)
        return same

    def check_all_unchanged(self) -> None:
        """Once every chunk is copied (the guard still holds the optimizer): a deferred source written in place
        since save() returned, by anything but the optimizer's step, may have been copied with its new values,
        so the save fails rather than keep them. Version counters move only when a write ends, hence one check
        at the end (a check per chunk would miss a write under way at it)."""
        for key, version, now in self.versions or ():
            if version >= 0 and now() != version:
                raise StateError(f"state[{key!r}] was written in place after save() returned and before the save copied it "
                                 "(not by the optimizer's step(), which waits for the copy): the save would hold the new "
                                 "values. Call handle.wait_staged() before writing it, or save with snapshot='eager'")

    def _check_alive(self, leaf: int, end: int) -> None:
        """Refuse to read past the memory a source holds now: a storage resized (to 0: freed, as FSDP does with
        unsharded parameters) after save() returned would otherwise be read after it was freed; one freed and
        allocated again has moved (its address at save() is known for the sources copied after it returned)."""
        src = self.sources[leaf]
        storage = src.untyped_storage()
        if src.storage_offset() + end > storage.nbytes():
            raise _freed(storage.nbytes())
        address = self.addresses[leaf] if self.addresses is not None else 0
        if address and self.originals[leaf].data_ptr() != address:
            raise _freed()

    def ready(self, i: int) -> None:
        event = self.events.pop(i, None)
        if event is not None:
            event.synchronize()

    def last_event(self) -> Any:
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event


def _freed(size: int | None = None) -> StateError:
    held = f" (its storage resized to {size} bytes)" if size is not None else ""
    return StateError(f"the memory of a tensor of this save was freed, shrunk or moved{held} after save() returned and "
                      "before the save copied it: keep the state's memory until the copy is done (handle.wait_staged()), "
                      "or save with snapshot='eager'")


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (a view when contiguous, else a contiguous copy)."""
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dim() == 0:
        t = t.reshape(1)
    return t.view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)
