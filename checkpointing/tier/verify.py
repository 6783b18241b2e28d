"""Check every byte of committed steps against their digests, without restoring them (I/O)."""

from __future__ import annotations

import dataclasses

from checkpointing.tier import catalog
from checkpointing.errors import CheckpointError
from checkpointing.tier.tierfile import read_tier_id
from checkpointing.format.manifest import chunk_digest
from checkpointing.storage import Storage


@dataclasses.dataclass(frozen=True)
class StepReport:
    step: int
    tensors: int
    bytes_checked: int
    problems: tuple[str, ...]
    elsewhere: int = 0  # shards whose every copy lives on another local tier (not checked here)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_step(storage: Storage, step: int) -> StepReport:
    """Read every chunk this tier holds for `step` and check its digest.

    A local tier holds the copies the file table places on it (its TIER id); shards of ranks on
    other local tiers are counted in `elsewhere`, not reported as missing. A tier without an id
    (the remote tier) must hold every primary copy.
    """
    try:
        manifest = catalog.load_manifest(storage, step)
    except CheckpointError as exc:
        return StepReport(step, 0, 0, (str(exc),))
    here = read_tier_id(storage)
    tier_of = {f.path: f.tier for f in manifest.files}
    problems: list[str] = []
    checked = elsewhere = 0
    buf = bytearray()
    for entry in manifest.tensors:
        for shard in entry.shards:
            if here is None:
                copies = [shard.chunks]
            else:
                copies = [c for c in shard.copies() if not c or tier_of.get(c[0].file, "") in ("", here)]
                if not copies:
                    elsewhere += 1
                    continue
            for copy in copies:
                for c in copy:
                    if len(buf) < c.length:
                        buf = bytearray(c.length)
                    view = memoryview(buf)[: c.length]
                    where = f"step {step}, tensor {entry.key!r}, {c.file} bytes {c.offset}..{c.offset + c.length}"
                    try:
                        storage.read_into(c.file, c.offset, view)
                    except FileNotFoundError:
                        problems.append(f"{where}: file missing")
                        continue
                    except EOFError:
                        problems.append(f"{where}: file truncated")
                        continue
                    if chunk_digest(view) != c.digest:
                        problems.append(f"{where}: digest mismatch (damaged bytes)")
                    checked += c.length
    return StepReport(step, len(manifest.tensors), checked, tuple(problems), elsewhere)
