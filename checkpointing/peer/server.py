"""The replica server of a node: a TCP listener on its leader rank, and its clients (layer: peer; I/O).

Threads: "ckpt-peer-server" accepts; each connection gets a "ckpt-peer-conn" thread (daemon) that
serves one request, then closes. Every request names the job's secret (from the store: only the
job's ranks know it) and one operation:

    push   a node sends its committed step here (transfer.receive_replica into peers/<its tier>)
    pull   a replaced node fetches a replica back (transfer.send_replica out of peers/<tier>)
    list   the steps committed in the replica of a tier (mgr.tiers(): "+peer")

The listener binds the address this host uses to reach the job's store (never 0.0.0.0): in tests,
127.0.0.1. Nothing here runs on the training thread or touches the training process group.
"""

from __future__ import annotations

import hmac
import logging
import socket
import threading
from typing import Any, Callable

from checkpointing.errors import CheckpointError
from checkpointing.format import naming
from checkpointing.peer.replica import ReplicaArea, check_tier_id
from checkpointing.peer.transfer import Pace, Sent, read_offer, receive_replica, send_replica
from checkpointing.peer.types import PeerLinkError
from checkpointing.peer.wire import VERSION, Link, expect

log = logging.getLogger("checkpointing")

Address = tuple[str, int]


class ReplicaServer:
    """Serves `area` to the job's other nodes. `accepts(tier)`: whether this node holds copies of that
    tier (push is refused otherwise); `after_commit(tier, step)` runs after each pushed replica
    committed, before its sender hears so (it must not raise)."""

    def __init__(self, area: ReplicaArea, *, host: str, rank: int, secret: str, timeout_s: float,
                 accepts: Callable[[str], bool], after_commit: Callable[[str, int], None]) -> None:
        self.area, self.rank, self._secret, self.timeout_s = area, rank, secret, timeout_s
        self._accepts, self._after_commit = accepts, after_commit
        self._sock = socket.create_server((host, 0))
        self.address: Address = (host, self._sock.getsockname()[1])
        self._conns: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="ckpt-peer-server", daemon=True)
        self._thread.start()

    def close(self, wait_s: float = 5.0) -> None:
        """Stop accepting; give the connections being served `wait_s` to finish."""
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._thread.join(wait_s)
        with self._lock:
            conns = list(self._conns)
        for t in conns:
            t.join(wait_s)

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, addr = self._sock.accept()
            except OSError:
                return  # closed
            t = threading.Thread(target=self._serve, args=(conn, addr), name="ckpt-peer-conn", daemon=True)
            with self._lock:
                self._conns.add(t)
            t.start()

    def _serve(self, conn: socket.socket, addr: Any) -> None:
        link = Link(conn, f"the node at {addr[0]}:{addr[1]}", self.timeout_s)
        try:
            req = link.recv()
            expect(req, link.who, "op", "secret", "v")
            if not hmac.compare_digest(str(req["secret"]), self._secret):
                raise PeerLinkError(f"{link.who} does not know this job's secret: not one of its ranks")
            who = f"rank {req.get('rank', '?')} at {addr[0]}"
            link.who = who
            op = req["op"]
            if op == "push":
                self._push(link, req)
            elif op == "pull":
                self._pull(link, req)
            elif op == "list":
                tier = check_tier_id(req.get("tier"))
                link.send({"ok": True, "steps": self.area.committed(tier)})
            else:
                raise PeerLinkError(f"{who} asked for {op!r} (protocol {req['v']}, this one is {VERSION})")
        except (CheckpointError, OSError) as exc:
            log.warning("checkpointing: rank %d's replica server: %s", self.rank, exc)
            try:
                link.send({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
            except CheckpointError:
                pass
        finally:
            link.close()
            with self._lock:
                self._conns.discard(threading.current_thread())

    def _push(self, link: Link, req: dict[str, Any]) -> None:
        tier = check_tier_id(req.get("tier"))
        if not self._accepts(tier):
            raise PeerLinkError(f"{link.who} pushed tier {tier}, which this node holds no copies of (the placement differs?)")
        ranks, world = req.get("ranks"), req.get("world_size")
        if not isinstance(ranks, list) or not all(isinstance(r, int) for r in ranks) or not isinstance(world, int):
            raise PeerLinkError(f"{link.who} did not say which ranks wrote tier {tier}")
        with self.area.lock(tier):
            self.area.set_source(tier, ranks, world)
            link.send({"ok": True, "ready": True})
            offer = read_offer(link, tier)
            got, reused = receive_replica(link, self.area.storage(tier), offer, rank=self.rank,
                                          then=lambda step: self._after_commit(tier, step))
        log.info("checkpointing: committed the peer copy of step %d from %s (%.1f MB received, %.1f MB held already) in %s",
                 offer.step, link.who, got / 1e6, reused / 1e6, self.area.storage(tier).url)

    def _pull(self, link: Link, req: dict[str, Any]) -> None:
        tier, step = check_tier_id(req.get("tier")), naming.check_step(req.get("step"))
        if step not in self.area.committed(tier):
            raise PeerLinkError(f"this node holds no committed copy of step {step} of tier {tier}")
        source = self.area.source(tier)
        if source is None:
            raise PeerLinkError(f"the copy of tier {tier} here does not say which ranks wrote it ({self.area.storage(tier).url})")
        link.send({"ok": True, "ready": True, "ranks": list(source[0]), "world_size": source[1]})
        send_replica(link, self.area.storage(tier), tier, step, pace=_unpaced)


def _unpaced(nbytes: int) -> None:
    return None


def _request(address: Address, who: str, secret: str, timeout_s: float, rank: int, msg: dict[str, Any]) -> Link:
    link = Link.connect(address[0], address[1], who, timeout_s)
    try:
        link.send({"v": VERSION, "secret": secret, "rank": rank, **msg})
        return link
    except BaseException:
        link.close()
        raise


def push(address: Address, who: str, *, secret: str, timeout_s: float, rank: int, storage: Any, tier: str, step: int,
         ranks: list[int], world_size: int, pace: Pace) -> Sent:
    """Copy committed `step` of this node's local tier (`storage`, id `tier`) to the peer at `address`."""
    link = _request(address, who, secret, timeout_s, rank, {"op": "push", "tier": tier, "ranks": ranks, "world_size": world_size})
    try:
        expect(link.recv(), who, "ready")
        return send_replica(link, storage, tier, step, pace=pace)
    finally:
        link.close()


def pull(address: Address, who: str, *, secret: str, timeout_s: float, rank: int, area: ReplicaArea, tier: str, step: int) -> tuple[int, int]:
    """Fetch the replica of `tier`, `step` from the node at `address` into this node's `area`: (bytes received, reused)."""
    link = _request(address, who, secret, timeout_s, rank, {"op": "pull", "tier": tier, "step": step})
    try:
        ready = link.recv()
        expect(ready, who, "ready", "ranks", "world_size")
        with area.lock(tier):
            area.set_source(tier, [int(r) for r in ready["ranks"]], int(ready["world_size"]))
            offer = read_offer(link, tier)
            if offer.step != step:
                raise PeerLinkError(f"{who} offered step {offer.step}, not {step}")
            return receive_replica(link, area.storage(tier), offer, rank=rank)
    finally:
        link.close()


def listed(address: Address, who: str, *, secret: str, timeout_s: float, rank: int, tier: str) -> list[int]:
    """The steps committed in the replica of `tier` at `address`."""
    link = _request(address, who, secret, timeout_s, rank, {"op": "list", "tier": tier})
    try:
        reply = link.recv()
        expect(reply, who, "steps")
        return [int(s) for s in reply["steps"]]
    finally:
        link.close()
