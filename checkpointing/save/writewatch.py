"""Incremental saves: which bytes of the state were certainly not written since the previous save
staged them, so that staging need not even read them (staging.py, reuse.py).

The exact test of reuse.py reads every byte of the state on every save (a memcmp with the staging
pool). Where the kernel can report written pages (pagewrites.py), a save first scans the page
ranges of its CPU sources. Bytes in pages not written since the previous save's scan still hold
what that save staged, which the pool still holds; only a chunk's pieces in written pages are
compared (`written_pieces`), and a chunk with none is the same without being read. A chunk whose
compared pieces differ is copied whole, as before. Pages a tensor shares with other objects at
its ends (heap allocations) thus cost a compare of the tensor's own bytes in them, not a whole chunk.

This holds only if the previous save's staging completed after its scan (a failed staging leaves
the pool holding older bytes), nothing else protected the pages between the two scans (a scan by
another watch, e.g. a second manager saving the same model, would hide writes from this one), and
the previous save scanned the same range. A watch therefore knows nothing on its first save, after
a failure, when its plan or pool changed, or after any other scan in the process.

Pages written on every save gain nothing and cost a minor fault per page per save (on the
training thread: 0.1-0.25 s per GB here). A range is therefore protected whole only once a
sample of it (its middle 1/`SAMPLE` of pages) stayed at most `HOT` written for one save interval;
the sample is looked at with a peek, which changes no protection. A range found more than `HOT`
written, whole or in its sample, is not protected again and is left out of the next saves
(compared instead) for a number of saves that doubles each time it is found hot again, up to
`MAX_REST`. Dense training thus faults on 1/`SAMPLE` of its pages a few times and settles to
comparing, as without a watch, while the frozen part of a fine-tuned model is read on the first
two saves and never again. A range that cannot be watched (shared memory, a file mapping) is
likewise asked again only after a doubling number of saves.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Any, Sequence

from checkpointing.save import pagewrites
from checkpointing.save.pagewrites import page_span

MIN_BYTES = 64 << 10  # smaller sources are compared: a scan costs more than reading them
HOT = 0.25  # a range with more of its bytes written than this is left out for a while
MAX_REST = 64  # saves a hot range is left out at most before it is scanned again
SAMPLE = 16  # a range is protected whole only after its middle 1/SAMPLE stayed cool for one save

Span = tuple[int, int]


@dataclasses.dataclass
class _Heat:
    rest: int = 0  # saves to go without scanning
    streak: int = 0  # consecutive scans that found the range hot
    sample: Span | None = None  # the slice of it the previous save protected, to be looked at now


class WriteWatch:
    """One staging pool's view of which of its sources were written between its saves."""

    def __init__(self, watcher: pagewrites.PageWatcher | None = None) -> None:
        self._watcher = watcher
        # the last completed staging: (plan, pool generation, watcher.seq after its scan, the
        # (source index, page span) pairs it scanned and left protected)
        self._done: tuple[Any, int, int, frozenset[tuple[int, Span]]] | None = None
        self._pending: tuple[Any, int, int, frozenset[tuple[int, Span]]] | None = None
        self._heat: dict[Span, _Heat] = {}

    def scan(self, plan: Any, generation: int, sources: Sequence[Span | None]) -> list[list[Span] | None]:
        """Per source of `plan` (its byte range [start, end), or None for one not to watch): the page
        spans written since this watch's previous completed staging with the same plan and pool
        allocation (`generation`), or None where that is unknown and every byte may have changed.
        Protects the scanned pages again; call `completed()` once every chunk is staged."""
        done, self._done, self._pending = self._done, None, None
        watcher = self._watcher or pagewrites.watcher()
        if watcher is None:
            return [None] * len(sources)
        self._watcher = watcher
        pages = [None if s is None or s[1] - s[0] < MIN_BYTES else page_span(*s) for s in sources]
        present = {p for p in pages if p is not None}
        self._heat = {p: h for p, h in self._heat.items() if p in present}
        wanted = sorted(p for p in present if self._wanted(p))
        seq0 = watcher.seq
        before = done[3] if done is not None and done[2] == seq0 else frozenset()  # else: someone scanned since
        known = {p for _, p in before}
        samples = {p: h.sample for p in wanted if (h := self._heat.get(p)) is not None and h.sample is not None}
        # the samples the previous save protected are only looked at (no protection changes): a hot
        # one is left out for a while, a cool one has its whole range protected now
        looked = _spans_of(watcher.peek, sorted(set(samples.values())))
        whole, fresh = [], []
        for p in wanted:
            if p in known:
                whole.append(p)  # protected whole last time, and cool then: scanned (protected again)
            elif p not in samples or looked[samples[p]] is None:
                fresh.append(p)  # new, back from a rest, or its mapping changed: sample it
            elif self._cool(p, samples[p], looked[samples[p]]):  # type: ignore[arg-type]
                whole.append(p)
        slices = {p: _middle(p) for p in fresh}
        targets = sorted(set(whole) | set(slices.values()))
        merged = merge_spans(targets)
        scanned = _spans_of(watcher.scan, targets, merged)
        alone = watcher.seq == seq0 + len(merged)  # else another watch's scan came between two of these
        found = {p: scanned[p] for p in whole}
        # a range protected whole that has turned hot (a layer unfrozen) is left out from now on; its
        # pages stay protected and cost one fault each at most, once
        hot = {p for p in whole if p in known and found[p] is not None and not self._cool(p, p, found[p])}  # type: ignore[arg-type]
        kept = {p for p in whole if found[p] is not None} - hot
        for p in fresh:
            if scanned[slices[p]] is not None:
                self._heat.setdefault(p, _Heat()).sample = slices[p]
        for p in {p for p in whole if found[p] is None} | {p for p in fresh if scanned[slices[p]] is None}:
            self._rest(p)  # cannot be watched (shared memory, ...): asked again after a while
        self._pending = (plan, generation, watcher.seq, frozenset((n, p) for n, p in enumerate(pages) if alone and p in kept))
        valid = alone and done is not None and done[0] is plan and done[1] == generation
        return [found.get(p) if p is not None and valid and (n, p) in before else None for n, p in enumerate(pages)]

    def completed(self) -> None:
        """Every chunk of the scanned save is staged: the next save may rely on its scan."""
        self._done, self._pending = self._pending, None

    def _wanted(self, span: Span) -> bool:
        heat = self._heat.get(span)
        if heat is None or heat.rest == 0:
            return True
        heat.rest -= 1
        return False

    def _cool(self, span: Span, looked: Span, dirty: list[Span]) -> bool:
        """Record what a look at `looked` (the range, or its sample) found; False when the range is
        hot and is left out for a while."""
        heat = self._heat.get(span)
        if heat is not None:
            heat.sample = None
        if sum(e - s for s, e in dirty) > HOT * (looked[1] - looked[0]):
            self._rest(span)
            return False
        if looked == span:  # cool as a whole: its history is forgotten
            self._heat.pop(span, None)
        return True

    def _rest(self, span: Span) -> None:
        heat = self._heat.setdefault(span, _Heat())
        heat.streak += 1
        heat.rest = min(2 ** heat.streak, MAX_REST)
        heat.sample = None


def _middle(span: Span) -> Span:
    """The middle 1/SAMPLE of a page span's pages (at least one page): away from the edge pages that
    a heap tensor shares with other objects."""
    lo, hi = span
    pages = (hi - lo) // pagewrites.PAGE
    n = max(1, pages // SAMPLE)
    start = lo + (pages - n) // 2 * pagewrites.PAGE
    return start, start + n * pagewrites.PAGE


def _spans_of(ask: Any, ranges: list[Span], merged: list[Span] | None = None) -> dict[Span, list[Span] | None]:
    """`ask(lo, hi)` (a watcher's scan or peek) once per span of the merged, sorted `ranges` (a page
    shared by two ranges is asked once); per range its written spans, or None if it cannot be watched."""
    found: dict[tuple[int, int], list[tuple[int, int]] | None] = {}
    k = 0
    for lo, hi in merge_spans(ranges) if merged is None else merged:
        spans = ask(lo, hi)
        while k < len(ranges) and ranges[k][1] <= hi:  # both sorted: the ranges inside this span
            p = ranges[k]
            found[p] = None if spans is None else [(max(s, p[0]), min(e, p[1])) for s, e in spans if s < p[1] and e > p[0]]
            k += 1
    return found


def merge_spans(spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted spans, those that overlap or touch merged."""
    out: list[tuple[int, int]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def written_pieces(chunks: Sequence[tuple[int, int, int]], sources: Sequence[tuple[int, int] | None],
                   dirty: Sequence[list[tuple[int, int]] | None]) -> list[list[tuple[int, int]] | None]:
    """Per chunk (source index, byte offset in the source, length): the pieces of it, as (offset in
    the chunk, length), that lie in pages written since the previous save (`dirty` from
    WriteWatch.scan, per source); None where that is unknown. Only these pieces can differ from
    what the previous save staged: an empty list means the chunk was not written at all."""
    out: list[list[tuple[int, int]] | None] = []
    starts = [None if d is None else [s for s, _ in d] for d in dirty]
    for n, offset, length in chunks:
        spans, src = dirty[n], sources[n]
        if spans is None or src is None:
            out.append(None)
            continue
        lo = src[0] + offset
        hi = lo + length
        k = max(0, bisect.bisect_right(starts[n], lo) - 1)  # type: ignore[arg-type]
        pieces = []
        while k < len(spans) and spans[k][0] < hi:
            s, e = max(spans[k][0], lo), min(spans[k][1], hi)
            if s < e:
                pieces.append((s - lo, e - s))
            k += 1
        out.append(pieces)
    return out
