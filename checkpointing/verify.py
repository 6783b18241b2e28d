"""Check every byte of committed steps against their digests, without restoring them (I/O)."""

from __future__ import annotations

import dataclasses

from . import catalog
from .errors import CheckpointError
from .manifest import chunk_digest
from .storage import Storage


@dataclasses.dataclass(frozen=True)
class StepReport:
    step: int
    tensors: int
    bytes_checked: int
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_step(storage: Storage, step: int) -> StepReport:
    try:
        manifest = catalog.load_manifest(storage, step)
    except CheckpointError as exc:
        return StepReport(step, 0, 0, (str(exc),))
    problems: list[str] = []
    checked = 0
    buf = bytearray()
    for entry in manifest.tensors:
        for shard in entry.shards:
            for c in shard.chunks:
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
    return StepReport(step, len(manifest.tensors), checked, tuple(problems))
