"""Check every byte of committed steps against their digests, without restoring them (I/O).

Memory is bounded whatever the manifest says: a chunk is read and hashed in pieces of at most
PIECE_BYTES, and a chunk that reaches past the end of its file (the real size, asked first) is
reported without reading it.
"""

from __future__ import annotations

import dataclasses

from checkpointing.errors import CheckpointError
from checkpointing.format import naming
from checkpointing.format.manifest import ChunkHasher, ChunkRef, Manifest
from checkpointing.storage import Storage
from checkpointing.tier import catalog
from checkpointing.tier.identity import tier_id_of

PIECE_BYTES = 8 << 20  # the most verify holds of one chunk at a time


ASK = object()  # missing_files / verify_step: ask tier_id_of for the tier's id


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


def missing_files(storage: Storage, manifest: Manifest, sizes: dict[str, int | None] | None = None, *, here: object = ASK) -> list[str]:
    """A line per data file of the step this tier should hold that is missing, not a regular file or of
    the wrong size: what can be told without reading the data (one size per file; an object store
    lists each directory instead; `sizes`: those already asked, the rest are asked here).
    `inspect`, `ls` and export show them; verify_step checks every byte. `here`: the tier's id as
    tier_id_of(storage) says (default: asked here; a caller going over many steps asks once)."""
    here = tier_id_of(storage) if here is ASK else here
    # the sizes each file may have: a local tier holds whole files, the remote tier (no id) at least their primary prefix
    expected = {f.path: (f.nbytes if here is not None else f.primary_bytes, f.nbytes)
                for f in manifest.files if here is None or f.tier in ("", here)}
    if not manifest.files:  # format v1: no file table, each file must at least hold its chunks
        for t in manifest.tensors:
            for sh in t.shards:
                for c in sh.chunks:
                    end = max(expected.get(c.file, (0, 0))[0], c.offset + c.length)
                    expected[c.file] = (end, 1 << 62)
    bad = []
    asked = dict(sizes or {})
    rest = sorted(set(expected) - asked.keys())
    if rest:
        asked.update(storage.sizes(rest))
    for path, (lo, hi) in sorted(expected.items()):
        found = asked[path]
        if found is None or not lo <= found <= hi:
            bad.append(f"{storage.url}/{path}: " + ("missing or not a regular file" if found is None else f"{found} bytes, expected {lo}"))
    return bad


def in_short(lost: list[str]) -> str:
    """missing_files' answer in one line: the first file, and how many more."""
    return lost[0] + (f" (and {len(lost) - 1} more)" if len(lost) > 1 else "")


def verify_step(storage: Storage, step: int, *, here: object = ASK) -> StepReport:
    """Read every chunk this tier holds for `step` and check its digest.

    A local tier holds the copies the file table places on it (its TIER id); shards of ranks on
    other local tiers are counted in `elsewhere`, not reported as missing. A tier without an id
    (the remote tier) must hold every primary copy. `here`: as missing_files.
    """
    try:
        manifest = catalog.load_manifest(storage, step)
    except CheckpointError as exc:
        return StepReport(step, 0, 0, (str(exc),))
    here = tier_id_of(storage) if here is ASK else here
    tier_of = {f.path: f.tier for f in manifest.files}
    # a file of another size than the file table says (the chunks below report a missing one, each)
    problems: list[str] = [p for p in missing_files(storage, manifest, here=here) if not p.endswith("missing or not a regular file")]
    checked = elsewhere = 0
    reader = _ChunkReader(storage)
    gone: dict[str, set[str]] = {}  # a missing file -> the tensors with chunks in it: said once per file
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
                    where = f"step {step}, tensor {entry.key!r}, {c.file} bytes {c.offset}..{c.offset + c.length}"
                    problem = reader.check(c)
                    if problem == "file missing":
                        gone.setdefault(c.file, set()).add(entry.key)
                    elif problem:
                        problems.append(f"{where}: {problem}")
                    else:
                        checked += c.length
    problems += [f"step {step}, {file}: file missing, with chunks of tensor(s) {', '.join(map(repr, sorted(keys)[:3]))}"
                 f"{' and more' if len(keys) > 3 else ''}{naming.borrowed_hint(step, file)}" for file, keys in gone.items()]
    return StepReport(step, len(manifest.tensors), checked, tuple(problems), elsewhere)


class _ChunkReader:
    """Reads chunks in bounded pieces; remembers each file's real size."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.sizes: dict[str, int | str] = {}  # file -> its size, or why it cannot be read
        self.buf = bytearray(0)

    def _size(self, file: str) -> int | str:
        if file not in self.sizes:
            try:
                self.sizes[file] = self.storage.size(file)
            except FileNotFoundError:
                self.sizes[file] = "file missing"
            except (CheckpointError, OSError) as exc:
                self.sizes[file] = f"cannot be read ({exc})"
        return self.sizes[file]

    def check(self, c: ChunkRef) -> str | None:
        """None when the chunk's bytes match its digest, else what is wrong."""
        size = self._size(c.file)
        if isinstance(size, str):
            return size
        if c.offset + c.length > size:
            return f"file truncated (it has {size} bytes)"
        hasher = ChunkHasher()
        done = 0
        while done < c.length:
            n = min(PIECE_BYTES, c.length - done)
            if len(self.buf) < n:
                self.buf = bytearray(n)
            view = memoryview(self.buf)[:n]
            try:
                self.storage.read_into(c.file, c.offset + done, view)
            except FileNotFoundError:
                return "file missing"
            except EOFError:
                return "file truncated"
            except (CheckpointError, OSError) as exc:
                return f"cannot be read ({exc})"
            hasher.update(view)
            done += n
        return None if hasher.digest() == c.digest else "digest mismatch (damaged bytes)"
