"""One replica over one connection: the sending side and the receiving side (layer: peer; I/O).

The same exchange copies a node's step to its peer after a save (push: the node sends, the peer
receives) and a replica back to a replaced node before a restore (pull: the holder sends):

    sender   -> {"op":"offer","step":N,"tier":T,"manifest":path,...} + manifest bytes + COMMIT bytes
    receiver -> {"need":[paths]}         the step's files on tier T it does not hold (reuse)
    sender   -> {"file":path,"nbytes":n} + n bytes, for each needed file in that order
    receiver -> {"ok":true} | {"ok":false,"error":...}   after each file: verified and durable
    receiver -> {"ok":true,"committed":N}                 after the replica's COMMIT

The receiver checks the offer before anything (COMMIT names the manifest's sha256, names are safe,
the files lie on tier T), pins the step in the replica directory before it decides which earlier
files it reuses (tier/pins.py: W1, W2), digests every chunk the manifest places in a file as the
bytes arrive, writes and fsyncs the file, and commits the replica (manifest, then COMMIT with an
exclusive create) only when every file is there with its size. A copy cut short leaves a step
directory without COMMIT: invisible, removed by the next start's tidying or collection.
"""

from __future__ import annotations

import dataclasses
import mmap
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterator

from checkpointing.errors import CheckpointCorruptError, CheckpointError, CommitConflictError, ManifestError
from checkpointing.format import naming
from checkpointing.format.decode import decode_commit, decode_manifest
from checkpointing.format.manifest import ChunkHasher, ChunkRef, FileEntry, Manifest, manifest_digest
from checkpointing.peer.replica import check_tier_id
from checkpointing.peer.types import PeerLinkError
from checkpointing.peer.wire import Link, expect
from checkpointing.storage import LocalStorage, Storage
from checkpointing.tier import catalog, pins
from checkpointing.tier.tierfile import read_tier_id

BLOCK = 8 << 20  # bytes per read, send, receive and write (a multiple of the O_DIRECT alignment)

Pace = Callable[[int], None]


@dataclasses.dataclass(frozen=True)
class Sent:
    bytes_sent: int
    bytes_reused: int  # files the receiver held already
    seconds: float


def send_replica(link: Link, storage: Storage, tier: str, step: int, *, pace: Pace, block: int = BLOCK) -> Sent:
    """Offer `step` of `storage` (a local tier, or a replica) and send the files of tier `tier` the
    receiver asks for, `block` bytes at a time, each paced; return once the receiver committed it
    (else PeerLinkError with its reason)."""
    t0 = time.perf_counter()
    marker_bytes = storage.get(naming.commit_name(step), max_bytes=catalog.MAX_COMMIT_BYTES)
    marker = catalog.read_commit(storage, step)
    data = storage.get(marker.manifest, max_bytes=catalog.MAX_MANIFEST_BYTES)
    if manifest_digest(data) != marker.manifest_digest:
        raise CheckpointCorruptError(f"step {step}: manifest {storage.url}/{marker.manifest} does not match its COMMIT; not copied")
    files = {f.path: f for f in decode_manifest(data, f"{storage.url}/{marker.manifest}").files if f.tier == tier}
    link.send({"op": "offer", "step": step, "tier": tier, "manifest": marker.manifest, "manifest_bytes": len(data),
               "commit_bytes": len(marker_bytes)}, data + marker_bytes)
    reply = link.recv()
    expect(reply, link.who, "need")
    need = reply["need"]
    if not isinstance(need, list) or any(p not in files for p in need):
        raise PeerLinkError(f"{link.who} asked for files step {step} does not hold on tier {tier}")
    sent = 0
    for path in need:
        entry = files[path]
        link.send({"file": path, "nbytes": entry.nbytes})
        for view in _file_blocks(storage, path, entry.nbytes, min(block, BLOCK)):
            pace(len(view))
            link.send_raw(view)
            sent += len(view)
        expect(link.recv(), link.who, "ok")
    expect(link.recv(), link.who, "committed")
    reused = sum(f.nbytes for p, f in files.items() if p not in need)
    return Sent(sent, reused, time.perf_counter() - t0)


@dataclasses.dataclass(frozen=True)
class Offer:
    """A checked offer: the step, its manifest (bytes and decoded), its COMMIT bytes, and its files on the tier."""

    step: int
    tier: str
    manifest_bytes: bytes
    commit_bytes: bytes
    manifest: Manifest
    files: tuple[FileEntry, ...]


def read_offer(link: Link, tier: str | None = None) -> Offer:
    """The sender's offer, checked (ManifestError says what is wrong with it)."""
    msg = link.recv()
    expect(msg, link.who, "op", "step", "tier", "manifest", "manifest_bytes", "commit_bytes")
    sizes = (msg["manifest_bytes"], msg["commit_bytes"])
    limits = (catalog.MAX_MANIFEST_BYTES, catalog.MAX_COMMIT_BYTES)
    if msg["op"] != "offer" or not all(isinstance(n, int) and not isinstance(n, bool) and 0 < n <= cap for n, cap in zip(sizes, limits)):
        raise PeerLinkError(f"{link.who} sent no valid offer")
    data, marker_bytes = link.recv_bytes(sizes[0]), link.recv_bytes(sizes[1])
    offered = check_tier_id(msg["tier"])
    if tier is not None and offered != tier:
        raise ManifestError(f"{link.who} offered tier {offered}, not the requested {tier}")
    step = naming.check_step(msg["step"])
    marker = decode_commit(marker_bytes, f"COMMIT of step {step} from {link.who}")
    if marker.step != step or marker.manifest != msg["manifest"] or not marker.manifest.startswith(naming.step_dir(step) + "/"):
        raise ManifestError(f"the COMMIT {link.who} offered does not name step {step}'s manifest {msg['manifest']!r}")
    if manifest_digest(data) != marker.manifest_digest:
        raise CheckpointCorruptError(f"the manifest of step {step} from {link.who} does not match its COMMIT (damaged in transit?)")
    manifest = decode_manifest(data, f"manifest of step {step} from {link.who}")
    if manifest.step != step:
        raise ManifestError(f"the manifest {link.who} offered is for step {manifest.step}, not {step}")
    files = tuple(f for f in manifest.files if f.tier == offered)
    return Offer(step, offered, data, marker_bytes, manifest, files)


def receive_replica(link: Link, storage: LocalStorage, offer: Offer, *, rank: int,
                    then: Callable[[int], None] | None = None) -> tuple[int, int]:
    """Take `offer` into the replica `storage`: (bytes received, bytes reused). Answers every error
    to the sender before raising it; the step is committed here when this returns. `then(step)` runs
    after the commit and before the sender hears of it (the host's retention on that replica)."""
    step = offer.step
    digest = catalog.committed_digest(storage, step)
    if digest is not None:
        if digest != manifest_digest(offer.manifest_bytes):
            _refuse(link, CommitConflictError(f"step {step} is committed in {storage.url} with another manifest (a step saved again "
                                              "under its number?); delete it there to copy this one"))
        link.send({"need": []})
        link.send({"ok": True, "committed": step})
        return 0, sum(f.nbytes for f in offer.files)
    own_dir = naming.step_dir(step) + "/"
    earlier = [f.path for f in offer.files if not f.path.startswith(own_dir)]
    pin = pins.write_pin(storage, step, rank, naming.new_token(), earlier)  # W1: before deciding what to reuse
    try:
        held = _held_files(storage)  # W2: files of steps committed now, protected by the pin from here on
        need = [f for f in offer.files if held.get(f.path) != f.nbytes or not storage.exists_with_size(f.path, f.nbytes)]
        link.send({"need": [f.path for f in need]})
        refs = _refs_by_file(offer.manifest)
        received = 0
        for f in need:
            head = link.recv()
            expect(head, link.who, "file", "nbytes")
            if head["file"] != f.path or head["nbytes"] != f.nbytes:
                raise PeerLinkError(f"{link.who} sent {head['file']!r} ({head['nbytes']} bytes), expected {f.path!r} ({f.nbytes})")
            try:
                receive_file(link, storage, f, refs.get(f.path, []))
            except CheckpointError as exc:
                _refuse(link, exc)
            link.send({"ok": True})
            received += f.nbytes
        try:
            commit_replica(storage, offer)
        except (CheckpointError, OSError) as exc:
            _refuse(link, exc if isinstance(exc, CheckpointError) else CheckpointError(f"committing in {storage.url}: {exc}"))
        if then is not None:
            then(step)
        link.send({"ok": True, "committed": step})
        return received, sum(f.nbytes for f in offer.files) - received
    finally:
        pins.remove_pin(storage, pin)


def _refuse(link: Link, exc: CheckpointError) -> None:
    """Tell the sender why, then raise."""
    try:
        link.send({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    except PeerLinkError:
        pass
    raise exc


def _held_files(storage: Storage) -> dict[str, int]:
    """Every file the committed steps of a replica list, with its size (each was verified when it arrived)."""
    out: dict[str, int] = {}
    tier = read_tier_id(storage)
    for s in catalog.list_steps(storage).committed:
        try:
            manifest = catalog.load_manifest(storage, s)
        except CheckpointError:
            continue  # a damaged step lends nothing
        out.update({f.path: f.nbytes for f in manifest.files if tier is None or f.tier == tier})
    return out


def _refs_by_file(manifest: Manifest) -> dict[str, list[ChunkRef]]:
    out: dict[str, set[ChunkRef]] = {}
    for t in manifest.tensors:
        for s in t.shards:
            for copy in s.copies():
                for c in copy:
                    out.setdefault(c.file, set()).add(c)
    return {path: sorted(refs, key=lambda c: (c.offset, c.length, c.digest)) for path, refs in out.items()}


class Verifier:
    """Digests every chunk reference of one file as its bytes arrive in order (a chunk may span blocks)."""

    def __init__(self, path: str, refs: list[ChunkRef], nbytes: int) -> None:
        self.path, self.refs, self._next = path, refs, 0
        self._active: list[tuple[ChunkRef, ChunkHasher]] = []
        bad = [c for c in refs if c.offset + c.length > nbytes]
        if bad:
            raise ManifestError(f"{path}: chunk at {bad[0].offset}+{bad[0].length} lies past the file's {nbytes} bytes")

    def feed(self, pos: int, block: memoryview) -> None:
        end = pos + len(block)
        while self._next < len(self.refs) and self.refs[self._next].offset < end:
            self._active.append((self.refs[self._next], ChunkHasher()))
            self._next += 1
        still = []
        for ref, hasher in self._active:
            lo, hi = max(ref.offset, pos), min(ref.offset + ref.length, end)
            if hi > lo:
                hasher.update(block[lo - pos:hi - pos])
            if ref.offset + ref.length > end:
                still.append((ref, hasher))
            elif hasher.digest() != ref.digest:
                raise CheckpointCorruptError(f"{self.path}: bytes {ref.offset}..{ref.offset + ref.length} arrived damaged "
                                             f"({hasher.digest()} != {ref.digest}): damaged at the source or in transit")
        self._active = still

    def finish(self) -> None:
        if self._active or self._next < len(self.refs):
            raise CheckpointCorruptError(f"{self.path}: ended before every chunk arrived")


def receive_file(link: Link, storage: LocalStorage, entry: FileEntry, refs: list[ChunkRef]) -> None:
    """Receive `entry.nbytes` bytes into `entry.path`, verified and fsynced; block k is written on a helper
    thread while block k + 1 arrives (two buffers). A damaged one is drained (the connection stays
    in step), removed, and raised as CheckpointCorruptError."""
    verifier = Verifier(entry.path, refs, entry.nbytes)
    storage.delete(entry.path)  # a crashed copy's leftover of an uncommitted step (never a committed step's file)
    stream = storage.open_stream(entry.path)
    bufs = (_block(), _block())
    error: CheckpointError | None = None
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="ckpt-peer-write") as pool:
            pending: Future[None] | None = None
            for k, pos in enumerate(range(0, entry.nbytes, BLOCK)):
                view = bufs[k % 2][:min(BLOCK, entry.nbytes - pos)]
                link.recv_into(view)  # the write of block k - 2 (this buffer) has finished: k - 1 was waited for
                if error is None:
                    try:
                        verifier.feed(pos, view)
                    except CheckpointError as exc:
                        error = exc  # drain the rest of the file
                if pending is not None:
                    pending.result()
                    pending = None
                if error is None:
                    pending = pool.submit(stream.write, view)
            if pending is not None:
                pending.result()
        if error is None:
            verifier.finish()
            stream.close()
    except BaseException:
        stream.abort()
        raise
    if error is not None:
        stream.abort()
        raise error


def _file_blocks(storage: Storage, path: str, nbytes: int, block: int) -> Iterator[memoryview]:
    """The file's bytes, `block` at a time; the next block is read on a helper thread while the caller
    sends this one (two buffers)."""
    bufs = (_block(), _block())
    starts = list(range(0, nbytes, block))

    def read(k: int) -> memoryview:
        view = bufs[k % 2][:min(block, nbytes - starts[k])]
        storage.read_into(path, starts[k], view)
        return view

    with ThreadPoolExecutor(1, thread_name_prefix="ckpt-peer-read") as pool:
        ahead = pool.submit(read, 0) if starts else None
        for k in range(len(starts)):
            assert ahead is not None
            view = ahead.result()
            ahead = pool.submit(read, k + 1) if k + 1 < len(starts) else None
            yield view


def _block() -> memoryview:
    """A page-aligned buffer of BLOCK bytes (O_DIRECT writes straight from it); freed with its last
    reference (an error's traceback may hold slices of it for a while, so it is never closed)."""
    return memoryview(mmap.mmap(-1, BLOCK))


def commit_replica(storage: LocalStorage, offer: Offer) -> None:
    """Every file of the step on its tier is here with its size: the manifest, then COMMIT (exclusive)."""
    step = offer.step
    marker = decode_commit(offer.commit_bytes, f"COMMIT of step {step}")
    for path, found, expected in catalog.size_mismatches(storage, [(f.path, f.nbytes) for f in offer.files]):
        what = "is missing" if found is None else f"has {found} bytes, not {expected}"
        raise CheckpointCorruptError(f"step {step} was not committed in {storage.url}: its file {path} {what}")
    storage.put(marker.manifest, offer.manifest_bytes)
    try:
        storage.put(naming.commit_name(step), offer.commit_bytes, exclusive=True)
    except FileExistsError:
        if storage.get(naming.commit_name(step), max_bytes=catalog.MAX_COMMIT_BYTES) != offer.commit_bytes:
            raise CommitConflictError(f"step {step} is committed in {storage.url} by another copy") from None
