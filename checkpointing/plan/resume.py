"""Which interrupted uploads a new job resumes, and which rank sends which file (pure).

At start-up each rank offers, for every step committed on its local tier and newer than the newest
step on the remote tier, the step's primary files (what the remote tier needs, with the rank that
wrote each) and the ones it holds whole. Every rank runs `resume_plan` on every rank's offer and so
reaches the same answer. A step is resumed when

- rank 0 offers it (it copies its own manifest and COMMIT to the remote tier), and no rank holds
  another save under that step number; ranks that do not hold it (a node added since) take part
  in its remote commit with nothing to send, and
- together the ranks hold every file it needs.

A file goes up from the rank that wrote it when that rank is in this job and holds it: at the same
world size each rank sends its own files, as the interrupted save would have. Otherwise (a restart
at another world size) it goes up from the lowest rank holding it: ranks of one node share its
local tier, so after a restart on fewer ranks that node's ranks still hold every file written there.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence


@dataclasses.dataclass(frozen=True)
class ResumeOffer:
    """One rank's offer for one step: its manifest's digest, the files the step needs (path, writer
    rank), and those of them this rank holds whole."""

    digest: str
    world_size: int  # the saving job's
    need: tuple[tuple[str, int], ...]
    have: frozenset[str]

    def to_json(self) -> dict[str, Any]:
        return {"digest": self.digest, "world_size": self.world_size, "need": [list(n) for n in self.need], "have": sorted(self.have)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "ResumeOffer":
        return cls(str(data["digest"]), int(data["world_size"]), tuple((str(p), int(r)) for p, r in data["need"]),
                   frozenset(str(p) for p in data["have"]))


@dataclasses.dataclass(frozen=True)
class ResumePlan:
    """Per resumed step, the files each rank sends (indexed by rank); the steps left, with why."""

    sends: Mapping[int, tuple[tuple[str, ...], ...]]
    left: Mapping[int, str]


def resume_plan(offers: Sequence[Mapping[int, ResumeOffer]]) -> ResumePlan:
    """The uploads to resume, given every rank's offers (offers[rank][step])."""
    world = len(offers)
    sends: dict[int, tuple[tuple[str, ...], ...]] = {}
    left: dict[int, str] = {}
    for step in sorted(set().union(*(o.keys() for o in offers)) if offers else ()):
        if step not in offers[0]:
            left[step] = "not committed on the local tier of rank 0 (which commits it on the remote tier)"
            continue
        present = [r for r in range(world) if step in offers[r]]
        need = offers[0][step].need
        if any(offers[r][step].digest != offers[0][step].digest for r in present):
            left[step] = "the ranks' local tiers hold different saves of it"
            continue
        per_rank: list[list[str]] = [[] for _ in range(world)]
        missing = []
        for path, writer in need:
            holders = [r for r in present if path in offers[r][step].have]
            if not holders:
                missing.append(path)
            else:
                per_rank[writer if writer in holders else holders[0]].append(path)
        if missing:
            left[step] = f"no rank of this job holds {len(missing)} of its files (e.g. {missing[0]})"
            continue
        sends[step] = tuple(tuple(p) for p in per_rank)
    return ResumePlan(sends, left)

