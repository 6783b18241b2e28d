"""How much each step stores on a tier when incremental saves share chunks between steps (pure).

For each step, the chunks it references on the tier (every copy placed there; on a tier without
an id, such as the remote tier, the primary copies) are split into:

- new: in files its own save wrote (its step directory);
- shared: also referenced by another of the steps given;
- unique: referenced by no other step given: what that step alone keeps stored.

Sizes count chunk bytes once per (file, offset, length), not the padding between chunks.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Mapping

from checkpointing.format import naming
from checkpointing.format.manifest import Manifest


@dataclasses.dataclass(frozen=True)
class StepUsage:
    referenced: int
    new: int
    unique: int
    shared: int


def _chunks(manifest: Manifest, tier: str | None) -> set[tuple[str, int, int]]:
    tier_of = {f.path: f.tier for f in manifest.files}
    out = set()
    for t in manifest.tensors:
        for s in t.shards:
            copies = [s.chunks] if tier is None else [c for c in s.copies() if c and tier_of.get(c[0].file, "") in ("", tier)]
            for copy in copies:
                out.update((c.file, c.offset, c.length) for c in copy)
    return out


def step_usage(manifests: Mapping[int, Manifest], tier: str | None) -> dict[int, StepUsage]:
    """`tier`: the local tier's id, or None for a tier that holds primary copies only."""
    chunks = {step: _chunks(m, tier) for step, m in manifests.items()}
    users = collections.Counter(c for cs in chunks.values() for c in cs)
    out = {}
    for step, cs in chunks.items():
        own = naming.step_dir(step) + "/"
        out[step] = StepUsage(
            referenced=sum(n for _, _, n in cs),
            new=sum(n for f, _, n in cs if f.startswith(own)),
            unique=sum(n for c in cs if users[c] == 1 for n in (c[2],)),
            shared=sum(n for c in cs if users[c] > 1 for n in (c[2],)),
        )
    return out
