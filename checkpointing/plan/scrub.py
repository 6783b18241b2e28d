"""Re-verification of borrowed chunks: which ones to read back after a save, and how fast (pure).

An incremental save takes chunks from earlier files (plan/reuse.py) and checks only that the
step they belong to is still committed and that the files have their sizes: a bit that rots in a
borrowed chunk would be taken by every later save. So after each committed save the chunks the
newest step borrows (its "candidates") are read back and digested on the ckpt-io thread
(save/scrub.py), a share per save, so that each is read at least once in any `every` consecutive
saves that borrow it. Chunks the save just wrote are not candidates until a later save borrows them.

The rule, per round (one round per committed save that borrowed anything):

- each candidate carries `since`: the first round of its current window (the round it first
  became a candidate, or the round after the one that last verified it);
- `must`: the candidates whose window ends this round (round >= since + every - 1), oldest first;
  they are read even if the next save is waiting (then without pacing);
- `extra`: the other candidates, oldest first, until this round's reads reach
  ceil(candidate bytes / every): steady work instead of a burst every `every` rounds; they are
  dropped when the next save is waiting (they stay due and come back as `must` in time);
- a chunk that stops being a candidate is forgotten (if it returns, its window starts again).

Reads are paced at `bytes_per_s` (`pace`): the next read waits until the bytes read so far are
within the budget for the time elapsed. With a budget too low for the share, the `must` reads of
a round delay the next save (it shows in its wait_prev_s); docs/design.md has the measured cost.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from checkpointing.format.manifest import ChunkRef

DEFAULT_EVERY = 10  # every borrowed chunk re-verified at least once in any 10 consecutive saves
DEFAULT_BYTES_PER_S = 200e6  # pace of the re-verification reads (a tenth of this machine's disk)

ChunkId = tuple[str, int, int, str]  # file, offset, length, digest


def chunk_id(ref: ChunkRef) -> ChunkId:
    return (ref.file, ref.offset, ref.length, ref.digest)


@dataclasses.dataclass(frozen=True)
class Selection:
    """One round's reads: `must` first (read whatever happens), then `extra` (dropped when busy)."""

    must: tuple[ChunkRef, ...]
    extra: tuple[ChunkRef, ...]

    @property
    def nbytes(self) -> int:
        return sum(c.length for c in self.must) + sum(c.length for c in self.extra)


def unique(candidates: Sequence[ChunkRef]) -> list[ChunkRef]:
    """The candidates without repeats, in order."""
    seen: set[ChunkId] = set()
    out = []
    for c in candidates:
        k = chunk_id(c)
        if k not in seen:
            seen.add(k)
            out.append(c)
    return out


def select(candidates: Sequence[ChunkRef], since: Mapping[ChunkId, int], round_: int, every: int) -> Selection:
    """What round `round_` reads of `candidates` (see the module docstring); `since` as `advance` left it."""
    chunks = unique(candidates)
    start = {chunk_id(c): since.get(chunk_id(c), round_) for c in chunks}
    order = sorted(chunks, key=lambda c: (start[chunk_id(c)], c.file, c.offset))
    must = [c for c in order if round_ >= start[chunk_id(c)] + every - 1]
    quota = -(-sum(c.length for c in chunks) // every)
    done = sum(c.length for c in must)
    extra = []
    for c in order:
        if done >= quota:
            break
        if round_ < start[chunk_id(c)] + every - 1:
            extra.append(c)
            done += c.length
    return Selection(tuple(must), tuple(extra))


def advance(since: Mapping[ChunkId, int], candidates: Sequence[ChunkRef], round_: int, verified: Sequence[ChunkRef]) -> dict[ChunkId, int]:
    """`since` after round `round_`: candidates only; those verified now get a fresh window from the next round."""
    done = {chunk_id(c) for c in verified}
    out = {}
    for c in candidates:
        k = chunk_id(c)
        out[k] = round_ + 1 if k in done else since.get(k, round_)
    return out


def pace(bytes_done: int, elapsed_s: float, bytes_per_s: float) -> float:
    """Seconds to wait before the next read so that `bytes_done` stays within the budget."""
    return max(0.0, bytes_done / bytes_per_s - elapsed_s)
