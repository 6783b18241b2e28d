"""Replicas on the receiving side, in one process: real local directories, a real loopback TCP socket.

A step committed by a real (one-rank) CheckpointManager is copied by the replica server's push and
pull (checkpointing/peer/server.py, transfer.py): layout, verification on arrival, commit, reuse of
files a replica holds already, and what a damaged or cut-short copy leaves (nothing restore trusts).
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest
import torch

from checkpointing import CheckpointManager
from checkpointing.errors import CheckpointCorruptError, ManifestError
from checkpointing.format import naming
from checkpointing.format.manifest import canonical_json
from checkpointing.peer.replica import PEERS_DIR, SOURCE_NAME, ReplicaArea
from checkpointing.peer.server import ReplicaServer, listed, pull, push
from checkpointing.peer.transfer import read_offer, receive_replica, send_replica
from checkpointing.peer.types import PeerLinkError
from checkpointing.peer.wire import MAGIC, Link
from checkpointing.storage import LocalStorage
from checkpointing.tier import catalog, collect
from checkpointing.tier.tierfile import read_tier_id
from checkpointing.tier.verify import verify_step

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SECRET = "s3cr3t"
N = 1 << 20  # 4 MiB of float32 per tensor


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(N, generator=g), "b": torch.randn(N // 4, generator=g), "step": seed}


@pytest.fixture
def source(tmp_path):
    """A node's local tier with steps 10 and 20 (20 incremental: `b` changed, `w` borrowed from 10)."""
    directory = tmp_path / "node0"
    with CheckpointManager(directory, keep_local=None, chunk_bytes=1 << 20) as mgr:
        s10 = _state(10)
        mgr.save(10, s10).wait()
        s20 = dict(s10, b=s10["b"] + 1, step=20)
        stats = mgr.save(20, s20).wait()
    assert stats.bytes_reused == N * 4  # `w` is borrowed from step 10's pack
    storage = LocalStorage(directory)
    return storage, read_tier_id(storage), {10: s10, 20: s20}


@pytest.fixture
def host(tmp_path):
    """Another node's local tier with a replica server on 127.0.0.1."""
    area = ReplicaArea(LocalStorage(tmp_path / "node1"))
    commits: list[tuple[str, int]] = []
    server = ReplicaServer(area, host="127.0.0.1", rank=1, secret=SECRET, timeout_s=10, accepts=lambda t: True,
                           after_commit=lambda tier, step: commits.append((tier, step)))
    yield area, server, commits
    server.close()


def _push(server, storage, tier, step, **kwargs):
    return push(server.address, "peer rank 1", secret=SECRET, timeout_s=10, rank=0, storage=storage, tier=tier, step=step,
                ranks=[0], world_size=1, pace=lambda n: None, **kwargs)


def test_push_commits_a_replica_with_the_tiers_layout_and_the_same_bytes(source, host):
    storage, tier, _ = source
    area, server, commits = host
    sent = _push(server, storage, tier, 10)
    replica = area.storage(tier)
    assert Path(replica.root) == Path(storage.root).parent / "node1" / PEERS_DIR / tier
    assert catalog.list_steps(replica).committed == [10] and commits == [(tier, 10)]
    # the step's files on the source's tier, its manifest and COMMIT: byte for byte the source's
    manifest = catalog.load_manifest(storage, 10)
    names = [f.path for f in manifest.files] + [naming.commit_name(10), catalog.read_commit(storage, 10).manifest]
    for name in names:
        assert replica.get(name) == storage.get(name), name
    assert sent.bytes_sent == sum(f.nbytes for f in manifest.files) and sent.bytes_reused == 0
    assert replica.get("TIER").decode() == tier  # the replica reads as the source's local tier
    assert replica.get(SOURCE_NAME) == canonical_json({"format_version": 3, "ranks": [0], "tier": tier, "world_size": 1})
    assert verify_step(replica, 10).ok
    assert area.inventory(1)[0].steps == (10,) and area.source(tier) == ((0,), 1)
    assert listed(server.address, "peer rank 1", secret=SECRET, timeout_s=5, rank=0, tier=tier) == [10]
    assert not [p for p in Path(replica.root).rglob("PIN.*")]  # the receiver's pin is gone


def test_an_incremental_step_sends_only_the_files_the_replica_lacks(source, host):
    storage, tier, _ = source
    area, server, _ = host
    first = _push(server, storage, tier, 10)
    second = _push(server, storage, tier, 20)
    new = [f for f in catalog.load_manifest(storage, 20).files if f.path.startswith(naming.step_dir(20))]
    assert second.bytes_sent == sum(f.nbytes for f in new) < first.bytes_sent / 4  # `b` only
    assert second.bytes_reused == first.bytes_sent  # step 10's pack, held already
    assert verify_step(area.storage(tier), 20).ok
    again = _push(server, storage, tier, 20)  # a committed replica: nothing to send
    assert again.bytes_sent == 0


def test_a_replica_pulled_back_restores_bit_exactly(source, host, tmp_path):
    storage, tier, states = source
    area, server, _ = host
    _push(server, storage, tier, 10)
    _push(server, storage, tier, 20)
    # the source node is replaced: a fresh disk fetches its old tier's replica back from the host
    fresh = ReplicaArea(LocalStorage(tmp_path / "node0-new"))
    got, reused = pull(server.address, "peer rank 1", secret=SECRET, timeout_s=10, rank=0, area=fresh, tier=tier, step=20)
    assert got == sum(f.nbytes for f in catalog.load_manifest(storage, 20).files) and reused == 0
    copy = fresh.storage(tier)
    assert catalog.list_steps(copy).committed == [20] and verify_step(copy, 20).ok and fresh.source(tier) == ((0,), 1)
    target = {"w": torch.zeros(N), "b": torch.zeros(N // 4), "step": -1}
    with CheckpointManager(copy.root, read_only=True) as mgr:  # the replica reads as the source's own local tier
        assert mgr.restore(target) == 20
    assert torch.equal(target["w"], states[20]["w"]) and torch.equal(target["b"], states[20]["b"]) and target["step"] == 20
    with pytest.raises(PeerLinkError, match="no committed copy of step 30"):
        pull(server.address, "peer rank 1", secret=SECRET, timeout_s=10, rank=0, area=fresh, tier=tier, step=30)


def _flip(storage: LocalStorage, step: int, at: int = 4096) -> str:
    path = next(f.path for f in catalog.load_manifest(storage, step).files if f.path.startswith(naming.step_dir(step)))
    full = Path(storage.root, path)
    data = bytearray(full.read_bytes())
    data[at] ^= 0xFF
    full.write_bytes(bytes(data))
    return path


def test_a_chunk_damaged_at_the_source_is_refused_and_nothing_is_committed(source, host):
    storage, tier, _ = source
    area, server, commits = host
    path = _flip(storage, 10)
    with pytest.raises(PeerLinkError) as err:
        _push(server, storage, tier, 10)
    assert "refused" in str(err.value) and "arrived damaged" in str(err.value) and path in str(err.value)
    replica = area.storage(tier)
    assert catalog.list_steps(replica).committed == [] and commits == []
    assert not Path(replica.root, path).exists()  # the damaged file was removed, the connection kept in step


def _pair(timeout_s: float = 5.0) -> tuple[Link, Link]:
    with socket.create_server(("127.0.0.1", 0)) as srv:
        a = socket.create_connection(srv.getsockname())
        b, _ = srv.accept()
    return Link(a, "the receiver", timeout_s), Link(b, "the sender", timeout_s)


class _CutShort:
    """A pacing function that closes the sender's socket once `after` bytes went out (the sender dies mid-copy)."""

    def __init__(self, link: Link, after: int) -> None:
        self.link, self.after, self.sent = link, after, 0

    def __call__(self, nbytes: int) -> None:
        self.sent += nbytes
        if self.sent > self.after:
            self.link.sock.shutdown(socket.SHUT_RDWR)


def test_a_copy_cut_short_leaves_an_invisible_step_that_tidying_removes(source, tmp_path):
    storage, tier, _ = source
    area = ReplicaArea(LocalStorage(tmp_path / "host"))
    to_receiver, to_sender = _pair()
    errors: list[BaseException] = []

    def sender() -> None:
        try:
            send_replica(to_receiver, storage, tier, 10, pace=_CutShort(to_receiver, 2 << 20), block=1 << 20)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    t = threading.Thread(target=sender)
    t.start()
    replica = area.storage(tier)
    with pytest.raises(PeerLinkError, match="closed the connection"):
        receive_replica(to_sender, replica, read_offer(to_sender, tier), rank=1)
    t.join()
    assert errors and isinstance(errors[0], PeerLinkError)
    listing = catalog.list_steps(replica)
    assert listing.committed == [] and listing.incomplete == [10]  # files of it may be there: invisible
    collect.remove_incomplete(replica)
    assert catalog.list_steps(replica) == catalog.StepListing([], [])


def test_offers_that_would_escape_or_lie_are_refused(source, tmp_path):
    storage, tier, _ = source
    marker = storage.get(naming.commit_name(10))
    manifest = storage.get(catalog.read_commit(storage, 10).manifest)

    def offered(msg: dict, payload: bytes) -> BaseException:
        to_receiver, to_sender = _pair()
        to_receiver.send(msg, payload)
        with pytest.raises((ManifestError, CheckpointCorruptError, PeerLinkError)) as err:
            read_offer(to_sender, msg.get("tier") if isinstance(msg.get("tier"), str) and "/" not in msg["tier"] else None)
        return err.value

    base = {"op": "offer", "step": 10, "tier": tier, "manifest": catalog.read_commit(storage, 10).manifest,
            "manifest_bytes": len(manifest), "commit_bytes": len(marker)}
    assert "not a tier id" in str(offered(dict(base, tier="../../etc"), manifest + marker))
    assert "does not name step 11" in str(offered(dict(base, step=11), manifest + marker))
    damaged = bytearray(manifest)
    damaged[10] ^= 1
    assert "does not match its COMMIT" in str(offered(base, bytes(damaged) + marker))
    to_receiver, to_sender = _pair()
    to_receiver.send_raw(b"GET / HTTP/1.1\r\n\r\n")
    with pytest.raises(PeerLinkError, match="does not speak the peer-copy protocol"):
        to_sender.recv()
    assert MAGIC == b"CKP1"


def test_the_server_refuses_strangers_and_unknown_tiers(source, tmp_path):
    storage, tier, _ = source
    area = ReplicaArea(LocalStorage(tmp_path / "host"))
    server = ReplicaServer(area, host="127.0.0.1", rank=1, secret=SECRET, timeout_s=5, accepts=lambda t: t != tier,
                           after_commit=lambda tier, step: None)
    try:
        with pytest.raises(PeerLinkError, match="does not know this job's secret"):
            push(server.address, "peer rank 1", secret="guess", timeout_s=5, rank=0, storage=storage, tier=tier, step=10,
                 ranks=[0], world_size=1, pace=lambda n: None)
        with pytest.raises(PeerLinkError, match="holds no copies of"):
            _push(server, storage, tier, 10)
        assert area.tiers() == []
    finally:
        server.close()
    with pytest.raises(PeerLinkError, match="connection refused"):
        _push(server, storage, tier, 10)
