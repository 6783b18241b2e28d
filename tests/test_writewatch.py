"""Kernel write watching for incremental saves (pagewrites.py, writewatch.py): every way memory can
be written shows up in the next scan, memory whose contents can change without a write here is
never called unwritten, and a save that skips unwritten chunks restores bit-exactly, against
change_detection="compare" on the same training run. The kernel tests skip where the kernel
cannot watch writes (then saves compare bytes, which test_incremental.py covers)."""

from __future__ import annotations

import ctypes
import mmap
import os
import tempfile
import threading

import numpy as np
import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from _models import assert_tree_equal, clone_tree
from checkpointing import CheckpointConfigError, CheckpointManager
from checkpointing.save import pagewrites
from checkpointing.save.pagewrites import PAGE, complement, page_span
from checkpointing.save.writewatch import HOT, MAX_REST, SAMPLE, WriteWatch, merge_spans, written_pieces

pytestmark = pytest.mark.usefixtures("one_torch_thread")

needs_kernel = pytest.mark.skipif(pagewrites.watcher() is None, reason="this kernel cannot watch page writes (Linux >= 6.7 with userfaultfd)")


def span_of(t: torch.Tensor) -> tuple[int, int]:
    return page_span(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())


def anon_floats(pages: int) -> torch.Tensor:
    """Zeros in a private anonymous mapping of their own: no other object shares their pages."""
    m = mmap.mmap(-1, pages * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(m, dtype=torch.float32)  # keeps `m` alive


def written_pages(spans) -> set[int]:
    return {a // PAGE for s, e in spans for a in range(s, e, PAGE)}


# ----------------------------------------------------------------------------- the kernel interface
@needs_kernel
def test_every_kind_of_write_is_seen_and_nothing_else():
    w = pagewrites.watcher()
    t = anon_floats(64)
    lo, hi = span_of(t)
    first = w.scan(lo, hi)
    assert written_pages(first) == set(range(lo // PAGE, hi // PAGE))  # never scanned: all of it counts
    assert w.scan(lo, hi) == []
    base = t.data_ptr()

    def page_of(byte: int) -> int:
        return (base + byte) // PAGE

    writes = {
        "index": (lambda: t.__setitem__(3, 1.0), 12),
        "data": (lambda: t.data[5 * PAGE // 4].add_(1), 5 * PAGE),
        "numpy": (lambda: t.numpy().__setitem__(9 * PAGE // 4 + 1, 2.0), 9 * PAGE + 4),
        "ctypes": (lambda: ctypes.memset(base + 20 * PAGE + 7, 3, 1), 20 * PAGE + 7),
        "thread": (lambda: _in_thread(lambda: t.view(torch.uint8).__setitem__(30 * PAGE, 4)), 30 * PAGE),
    }
    for name, (write, byte) in writes.items():
        write()
        assert written_pages(w.scan(lo, hi)) == {page_of(byte)}, name
    with tempfile.TemporaryFile() as f:  # the kernel itself writes the pages (copy_to_user)
        f.write(b"x" * (3 * PAGE))
        f.seek(0)
        f.readinto(memoryview(t.numpy()).cast("B")[40 * PAGE:43 * PAGE])
    assert written_pages(w.scan(lo, hi)) == set(range(page_of(40 * PAGE), page_of(43 * PAGE - 1) + 1))
    t.add_(1)  # everything, through torch's kernels
    assert written_pages(w.scan(lo, hi)) == set(range(lo // PAGE, hi // PAGE))
    assert w.scan(lo, hi) == []


def _in_thread(fn) -> None:
    th = threading.Thread(target=fn)
    th.start()
    th.join()


@needs_kernel
def test_pages_dropped_without_a_write_count_as_written():
    """MADV_DONTNEED turns anonymous pages into zeros without a write; munmap removes them."""
    w = pagewrites.watcher()
    m = mmap.mmap(-1, 16 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = ctypes.c_char.from_buffer(m)
    lo = ctypes.addressof(view)
    del view
    m.write(b"\1" * (16 * PAGE))
    w.scan(lo, lo + 16 * PAGE)
    assert w.scan(lo, lo + 16 * PAGE) == []
    m.madvise(mmap.MADV_DONTNEED, 4 * PAGE, PAGE)
    assert m[4 * PAGE] == 0  # the contents changed: no write did it
    assert written_pages(w.scan(lo, lo + 16 * PAGE)) == {lo // PAGE + 4}
    m.close()
    after = w.scan(lo, lo + 16 * PAGE)
    assert after is None or written_pages(after) == set(range(lo // PAGE, lo // PAGE + 16))


@needs_kernel
def test_shared_and_file_backed_memory_is_not_watched():
    """Another process (or the file) can change it without a write through this mapping."""
    w = pagewrites.watcher()
    shared = torch.zeros(64 * PAGE // 4).share_memory_()
    assert w.scan(*span_of(shared)) is None
    m = mmap.mmap(-1, 8 * PAGE, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    view = ctypes.c_char.from_buffer(m)
    lo = ctypes.addressof(view)
    del view
    assert w.scan(lo, lo + 8 * PAGE) is None
    m.close()
    with tempfile.NamedTemporaryFile() as f:
        f.write(b"\0" * (8 * PAGE))
        f.flush()
        mapped = torch.from_file(f.name, shared=False, size=8 * PAGE, dtype=torch.uint8)
        assert w.scan(*span_of(mapped)) is None


@needs_kernel
def test_a_forked_child_gets_its_own_watcher_and_its_writes_stay_its_own():
    w = pagewrites.watcher()
    t = anon_floats(16)
    t.fill_(1)
    lo, hi = span_of(t)
    w.scan(lo, hi)
    r, wr = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: write its copy, check its own watcher sees its write
        ok = 0
        try:
            ctypes.memset(t.data_ptr(), 9, PAGE)
            child = pagewrites.watcher()
            ok = int(child is not None and child is not w and child.pid == os.getpid())
        finally:
            os.write(wr, bytes([ok]))
            os._exit(0)
    os.close(wr)
    got = os.read(r, 1)
    os.waitpid(pid, 0)
    os.close(r)
    assert got == b"\1"
    assert w.scan(lo, hi) == [] and bool(torch.all(t == 1))


# ----------------------------------------------------------------------------- one pool's watch
@needs_kernel
def test_a_watch_knows_only_what_its_own_completed_scans_tell():
    t = anon_floats(64)
    src = [(t.data_ptr(), t.data_ptr() + t.numel() * 4)]
    plan = object()
    a, b = WriteWatch(), WriteWatch()
    assert a.scan(plan, 1, src) == [None]  # first scan: nothing known; a sample of the range is protected
    a.completed()
    assert a.scan(plan, 1, src) == [None]  # the sample stayed unwritten: now the whole range is
    a.completed()
    assert a.scan(plan, 1, src) == [[]]
    a.completed()
    t[0] = 1
    assert written_pages(a.scan(plan, 1, src)[0]) == {t.data_ptr() // PAGE}
    # staging did not complete: the pool may hold older bytes, so the next save knows nothing
    assert a.scan(plan, 1, src) == [None]
    a.completed()
    b.scan(plan, 1, src)  # a scan by another watch re-protects the pages: `a` cannot tell what changed
    b.completed()
    assert a.scan(plan, 1, src) == [None]
    a.completed()
    assert a.scan(object(), 1, src) == [None]  # another plan: the pool holds another layout
    a.completed()
    assert a.scan(plan, 2, src) == [None]  # a new pool allocation
    a.completed()
    assert a.scan(plan, 2, src[::-1] + [None]) == [[], None]
    a.completed()
    small = torch.zeros(16)
    assert a.scan(plan, 2, src + [(small.data_ptr(), small.data_ptr() + 64)]) == [[], None]  # small sources are compared


@needs_kernel
def test_sources_that_trade_places_are_not_taken_for_each_other():
    """Unwritten pages say the bytes at an address did not change: only for the same source there."""
    x, y = anon_floats(32), anon_floats(32)
    rx, ry = (x.data_ptr(), x.data_ptr() + 32 * PAGE), (y.data_ptr(), y.data_ptr() + 32 * PAGE)
    plan, watch = object(), WriteWatch()
    watch.scan(plan, 1, [rx, ry])
    watch.completed()
    assert watch.scan(plan, 1, [ry, rx]) == [None, None]


@needs_kernel
def test_a_range_written_on_every_save_is_left_out_for_a_doubling_number_of_saves():
    t = anon_floats(64)
    src = [(t.data_ptr(), t.data_ptr() + t.numel() * 4)]
    plan, watch, w = object(), WriteWatch(), pagewrites.watcher()
    watch.scan(plan, 1, src)
    watch.completed()
    # only the middle 1/SAMPLE is protected until it stays cool: dense training never faults on the rest
    lo, hi = span_of(t)
    unprotected = written_pages(w.peek(lo, hi))
    assert len(unprotected) == (hi - lo) // PAGE - (hi - lo) // PAGE // SAMPLE
    assert (lo + hi) // 2 // PAGE not in unprotected
    rests = []
    for save in range(40):
        t.add_(1)  # dense training: everything changes
        seq = w.seq
        got = watch.scan(plan, 1, src)[0]
        watch.completed()
        rests.append(w.seq == seq)  # not protected again: at most peeked at
        if got is not None:
            assert written_pages(got) == set(range(span_of(t)[0] // PAGE, span_of(t)[1] // PAGE))
    # peeked at and found hot, left out 2 saves, probed (protected; knows nothing), peeked at and
    # found hot, left out 4, ...
    assert rests[:12] == [True, True, True, False, True, True, True, True, True, False, True, True]
    assert max(len(run) for run in "".join("x" if r else "." for r in rests).split(".")) <= MAX_REST
    t.zero_()  # cools down: from the next probe on it is watched again
    for _ in range(2 * MAX_REST):
        watch.scan(plan, 1, src)
        watch.completed()
    assert watch.scan(plan, 1, src) == [[]]
    watch.completed()
    t.add_(1)  # hot again while protected whole (a layer unfrozen): reported, then left out
    assert written_pages(watch.scan(plan, 1, src)[0]) == set(range(lo // PAGE, hi // PAGE))
    watch.completed()
    seq = w.seq
    assert watch.scan(plan, 1, src) == [None] and w.seq == seq
    assert HOT < 1


# ----------------------------------------------------------------------------- the pure parts
spans_st = st.lists(st.tuples(st.integers(0, 60), st.integers(1, 8)), max_size=12).map(
    lambda xs: merge_spans([(s * PAGE, (s + n) * PAGE) for s, n in xs]))


@settings(max_examples=200, deadline=None)
@given(spans_st, st.integers(0, 70), st.integers(1, 20))
def test_span_arithmetic_matches_page_sets(spans, start, n):
    pages = written_pages(spans)
    lo, hi = start * PAGE, (start + n) * PAGE
    assert written_pages(complement(lo, hi, spans)) == set(range(start, start + n)) - pages
    assert all(a[1] < b[0] for a, b in zip(spans, spans[1:]))  # merged: sorted, apart


@settings(max_examples=200, deadline=None)
@given(spans_st, st.lists(st.tuples(st.integers(0, 300_000), st.integers(1, 50_000)), min_size=1, max_size=10),
       st.integers(0, 4095))
def test_a_chunks_written_pieces_are_its_bytes_in_written_pages(spans, chunks, misalign):
    src = [(misalign, misalign + 400_000), None]
    got = written_pieces([(0, o, n) for o, n in chunks] + [(1, 0, 10)], src, [spans, None])
    assert got[-1] is None  # a source with nothing known: compare it all
    pages = written_pages(spans)
    for (o, n), pieces in zip(chunks, got):
        want = {b for b in range(o, o + n) if (misalign + b) // PAGE in pages}
        have = {o + a for p, k in pieces for a in range(p, p + k)}
        assert have == want
        assert all(a[0] + a[1] <= b[0] for a, b in zip(pieces, pieces[1:]))


# ----------------------------------------------------------------------------- saves
class Tuned(nn.Module):
    """A frozen 4 MB base of 16 tensors and a trained head."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.base = nn.ParameterList([nn.Parameter(torch.randn(256, 256), requires_grad=False) for _ in range(16)])
        self.head = nn.Linear(256, 8)

    def forward(self, x):
        for p in self.base:
            x = torch.tanh(x @ p)
        return self.head(x)


def _no_grad(fn) -> None:
    with torch.no_grad():
        fn()


def _train(net: Tuned, opt, gen: torch.Generator) -> None:
    loss = net(torch.randn(4, 256, generator=gen)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


EDITS = [
    ("data", lambda net: net.base[3].data[7, 7].add_(1)),
    ("numpy", lambda net: net.base[5].detach().numpy().__setitem__((100, 3), 5.0)),
    ("thread", lambda net: _in_thread(lambda: net.base[9].data[200].mul_(2))),
    ("replaced", lambda net: setattr(net.base[11], "data", net.base[11].data * 3)),
    ("set_", lambda net: _no_grad(lambda: net.base[12].set_(torch.full((256, 256), 0.5)))),
    ("copy_", lambda net: net.base[13].data.copy_(torch.ones(256, 256))),
    ("fill_untouched", lambda net: None),
]


@pytest.mark.parametrize("detection", ["auto", "compare"])
def test_saves_that_skip_unwritten_memory_restore_every_step_bit_exactly(tmp_path, detection):
    net = Tuned()
    opt = torch.optim.AdamW(net.head.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    expected, stats = {}, []
    with CheckpointManager(tmp_path / "ckpt", keep_local=None, change_detection=detection) as mgr:
        # the first save protects a sample of each range, the second all of it: edits from the third on
        for step, (name, edit) in enumerate([("first", lambda net: None), ("second", lambda net: None)] + EDITS):
            _train(net, opt, gen)
            edit(net)
            state = {"model": net, "optim": opt}
            stats.append(mgr.save(step, state).wait())
            expected[step] = clone_tree({"model": net.state_dict(), "optim": opt.state_dict()})
        for step in expected:
            fresh = Tuned(seed=9)
            fresh_opt = torch.optim.AdamW(fresh.head.parameters(), lr=1e-2)
            _train(fresh, fresh_opt, torch.Generator().manual_seed(5))
            mgr.restore({"model": fresh, "optim": fresh_opt}, step=step)
            assert_tree_equal({"model": fresh.state_dict(), "optim": fresh_opt.state_dict()}, expected[step])
    base_bytes = 16 * 256 * 256 * 4
    for s, (name, _) in zip(stats[2:], EDITS):
        assert s.bytes_written < base_bytes / 4, (name, s)  # the edit's chunk and the head, not the base
        if detection == "compare" or pagewrites.watcher() is None:
            assert s.bytes_unwritten == 0
        else:  # the base tensors the edits did not touch were not even read; a tensor replaced by new
            # memory is compared on the save that finds it and the next (sampled, then protected whole)
            assert s.bytes_unwritten >= base_bytes - 3 * 256 * 256 * 4, (name, s)
    # the edits of the base were caught, so each of those saves wrote its edited chunk
    by_name = {name: s for s, (name, _) in zip(stats[2:], EDITS)}
    quiet = by_name["fill_untouched"].bytes_written
    for name in ("data", "numpy", "thread", "replaced", "set_", "copy_"):
        assert by_name[name].bytes_written > quiet, (name, by_name[name], quiet)


def test_change_detection_is_validated(tmp_path):
    with pytest.raises(CheckpointConfigError, match="change_detection"):
        CheckpointManager(tmp_path, change_detection="hooks")
