"""Committing a step across ranks through the torch.distributed store (I/O; the merge is pure).

The background writer of each rank talks only to the key-value store (its own TCPStore client,
never a collective on the training process group), so training never waits on another rank's disk.
Per save (numbered `seq`, the same on every rank):

    ws/<rank>      what replicated tensors this rank writes (its local-tier peers skip those bytes)
    part/<rank>    its report after writing and fsyncing (merge.RankPart), or its error
    manifest       rank 0's merged manifest (or nothing, if the step failed)
    ack/<rank>     each local tier's leader wrote manifest + COMMIT there, or its error
    status         rank 0's verdict: committed, or which ranks failed and why

Every wait polls with a deadline (timeout_s) and names the ranks that did not answer. A world of
one rank uses LocalCoordinator: the same merge and commit, no store.
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
import secrets
import threading
import time
from typing import Any, Callable

from checkpointing.tier import catalog
from checkpointing.errors import CheckpointError, CoordinationLost, CoordinationTimeout, MergeError, PeerFailed, RanksFailedError
from checkpointing.format.manifest import Manifest, decode_manifest, encode_manifest, manifest_digest
from checkpointing.format.rank_reports import RankPart, decode_part, encode_part, merge_parts
from checkpointing.storage import LocalStorage
from checkpointing.tier.tierfile import ensure_tier_id

log = logging.getLogger("checkpointing")

_POLL_S = (0.001, 0.01)  # first and largest interval between polls of the store


def store_errors(fn: Callable) -> Callable:
    """Store failures (a DistError from the C++ client) become one clear CheckpointError."""

    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except CheckpointError:
            raise
        except RuntimeError as exc:  # torch.distributed.DistError and its subclasses
            raise CoordinationLost(
                f"rank {self.rank} lost the torch.distributed store ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); "
                "its host (rank 0 with a tcp:// init method, or the torchrun agent) has probably exited"
            ) from None

    return wrapper


class LocalCoordinator:
    """One rank: commit straight to the local tier."""

    rank = 0
    world_size = 1
    leader = True

    def __init__(self, storage: LocalStorage) -> None:
        self.storage = storage
        self.tiers = (ensure_tier_id(storage),)
        self.per_rank_keys: frozenset[str] = frozenset()

    def share_written(self, job: Any, written: list) -> None:
        job.exchanged = True

    def peer_written(self, job: Any) -> set:
        return set()

    def fail(self, job: Any, error: BaseException) -> None:
        pass

    def commit(self, job: Any, part: RankPart) -> Manifest:
        try:
            manifest, _ = merge_parts(job.step, [part], self.tiers)
        except MergeError as exc:
            raise CheckpointError(f"step {job.step} cannot be committed: {exc}") from None
        job.manifest_digest = catalog.commit_bytes(self.storage, job.step, encode_manifest(manifest), job.token)
        return manifest

    def barrier(self, name: str) -> None:
        pass

    def close(self) -> None:
        pass


class StoreCoordinator:
    """Many ranks: parts, manifest and verdict travel through the store; rank 0 merges."""

    def __init__(self, storage: LocalStorage, group: Any, *, timeout_s: float, namespace: str) -> None:
        import torch.distributed as dist

        self.storage = storage
        self.timeout_s = timeout_s
        self.group, self.namespace = group, namespace
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.store = _store_client(group, namespace, timeout_s)
        self._restores = 0
        self.per_rank_keys: frozenset[str] = frozenset()
        self._per_rank_pending: list[str] = []
        # which ranks share a local tier: every rank publishes the id found in its directory
        self.store.set(f"init/tier/{self.rank}", ensure_tier_id(storage))
        keys = [f"init/tier/{r}" for r in range(self.world_size)]
        self._wait(keys, time.monotonic() + timeout_s, "starting the checkpoint manager", keys_rank=lambda k: int(k.rsplit("/", 1)[1]))
        self.tiers = tuple(v.decode("ascii") for v in self.store.multi_get(keys))
        self.leader = self.rank == min(r for r in range(self.world_size) if self.tiers[r] == self.tiers[self.rank])
        self.leaders = sorted({min(r for r in range(self.world_size) if self.tiers[r] == t) for t in self.tiers})

    # ------------------------------------------------------------ during a save (background thread)

    @store_errors
    def share_written(self, job: Any, written: list[tuple[str, tuple[int, ...] | None, str]]) -> None:
        payload = [[k, None if o is None else list(o), d] for k, o, d in written]
        self.store.set(self._key(job, f"ws/{self.rank}"), json.dumps({"ok": True, "written": payload}))
        job.exchanged = True

    @store_errors
    def peer_written(self, job: Any) -> set[tuple[str, tuple[int, ...] | None, str]]:
        peers = [r for r in range(self.world_size) if r != self.rank and self.tiers[r] == self.tiers[self.rank]]
        keys = [self._key(job, f"ws/{r}") for r in peers]
        self._wait(keys, time.monotonic() + self.timeout_s, f"step {job.step}: waiting for local-tier peers", keys_rank=rank_of)
        out: set = set()
        for r, raw in zip(peers, self.store.multi_get(keys) if keys else []):
            msg = json.loads(raw)
            if not msg["ok"]:
                raise PeerFailed(r)
            out.update((k, None if o is None else tuple(o), d) for k, o, d in msg["written"])
        return out

    def fail(self, job: Any, error: BaseException) -> None:
        """This rank's part of the save failed: tell the others now, so nobody waits for a timeout."""
        cause = "aborted because another rank failed" if isinstance(error, PeerFailed) else f"{type(error).__name__}: {error}"
        try:
            if not job.exchanged:
                self.store.set(self._key(job, f"ws/{self.rank}"), json.dumps({"ok": False}))
                job.exchanged = True
            self.store.set(self._key(job, f"part/{self.rank}"), json.dumps({"ok": False, "error": cause, "root": not isinstance(error, PeerFailed)}))
        except Exception as exc:  # noqa: BLE001 - the store is gone too: the others will time out
            log.warning("checkpointing: could not report rank %d's failure of step %d: %s", self.rank, job.step, exc)

    @store_errors
    def commit(self, job: Any, part: RankPart) -> Manifest:
        """Report this rank's part; rank 0 merges; every tier's leader commits there. Raises if any rank failed."""
        self.store.set(self._key(job, f"part/{self.rank}"), encode_part(part))
        return self.finish(job)

    @store_errors
    def finish(self, job: Any) -> Manifest:
        deadline = time.monotonic() + self.timeout_s
        merged = self.rank == 0 and self._merge(job, deadline)
        # rank 0 may spend timeout_s on the reports and again on the tiers' commits: others wait longer
        later = deadline + self.timeout_s
        manifest = None
        if self.leader:
            manifest = self._commit_tier(job, deadline if self.rank == 0 else later)
        if merged:
            self._collect_acks(job, later)
        status = self._status(job, later + self.timeout_s)
        if not status["ok"]:
            raise RanksFailedError(job.step, {int(r): c for r, c in status["failures"].items()})
        self.per_rank_keys = frozenset(status["per_rank_keys"])
        if manifest is None:
            data = self.store.get(self._key(job, "manifest"))
            manifest = decode_manifest(data, f"step {job.step} manifest from rank 0")
            job.manifest_digest = manifest_digest(data)  # what its tier leader's COMMIT names
        return manifest

    def _merge(self, job: Any, deadline: float) -> bool:
        """Rank 0: merge every rank's part and publish the manifest; False if the step already failed."""
        keys = [self._key(job, f"part/{r}") for r in range(self.world_size)]
        try:
            self._wait(keys, deadline, f"step {job.step}: waiting for every rank's report", keys_rank=rank_of)
        except CoordinationTimeout as exc:
            self._verdict(job, {r: str(exc) for r in exc.ranks})
            return False
        if job.seq > 0:  # every rank reported this save, so all are done with the previous one
            self._delete_seq(job.seq - 1)
        raw = self.store.multi_get(keys)
        failures, roots, parts = {}, {}, []
        for r, data in enumerate(raw):
            msg = json.loads(data)
            if msg.get("ok") is False:
                (roots if msg.get("root") else failures)[r] = msg["error"]
            else:
                parts.append(decode_part(data))
        if roots or failures:
            self._verdict(job, roots or failures)
            return False
        try:
            manifest, per_rank = merge_parts(job.step, parts, self.tiers)
        except MergeError as exc:
            self._verdict(job, {0: f"the ranks' reports do not form a consistent checkpoint: {exc}"})
            return False
        self._per_rank_pending = sorted(per_rank)
        self.store.set(self._key(job, "manifest"), encode_manifest(manifest))
        return True

    def _collect_acks(self, job: Any, deadline: float) -> None:
        """Rank 0: wait for every local tier's commit, then give the verdict."""
        acks = [self._key(job, f"ack/{r}") for r in self.leaders]
        try:
            self._wait(acks, deadline, f"step {job.step}: waiting for each local tier's commit", keys_rank=rank_of)
        except CoordinationTimeout as exc:
            return self._verdict(job, {r: str(exc) for r in exc.ranks})
        failures = {r: m["error"] for r, m in zip(self.leaders, map(json.loads, self.store.multi_get(acks))) if not m["ok"]}
        self._verdict(job, failures, per_rank=self._per_rank_pending)

    def _verdict(self, job: Any, failures: dict[int, str], per_rank: list[str] | None = None) -> None:
        status = {"ok": not failures, "failures": {str(r): c for r, c in failures.items()}, "per_rank_keys": per_rank or []}
        self.store.set(self._key(job, "status"), json.dumps(status))

    def _commit_tier(self, job: Any, deadline: float) -> Manifest | None:
        manifest_key, status_key = self._key(job, "manifest"), self._key(job, "status")
        while not self.store.check([manifest_key]):
            if self.store.check([status_key]):
                return None  # rank 0 gave its verdict without a manifest: the step failed
            _sleep_until(deadline, f"step {job.step}: rank 0 (the coordinator) published no manifest in time; it may have died")
        data = self.store.get(manifest_key)
        try:
            job.manifest_digest = catalog.commit_bytes(self.storage, job.step, data, job.token)
            ack = {"ok": True}
        except Exception as exc:  # noqa: BLE001 - reported to rank 0, which fails the step everywhere
            ack = {"ok": False, "error": f"committing on its local tier {self.storage.url}: {type(exc).__name__}: {exc}"}
        self.store.set(self._key(job, f"ack/{self.rank}"), json.dumps(ack))
        return decode_manifest(data, f"step {job.step} manifest") if ack["ok"] else None

    def _status(self, job: Any, deadline: float) -> dict[str, Any]:
        key = self._key(job, "status")
        self._wait([key], deadline, f"step {job.step}: waiting for rank 0's verdict", keys_rank=lambda k: 0)
        return json.loads(self.store.get(key))

    def _delete_seq(self, seq: int) -> None:
        names = ["manifest", "status"] + [f"{k}/{r}" for k in ("ws", "part", "ack") for r in range(self.world_size)]
        for name in names:
            try:
                self.store.delete_key(f"save/{seq}/{name}")
            except Exception:  # noqa: BLE001 - a leftover key costs a few bytes, nothing more
                pass

    # ------------------------------------------------------------ collective calls (training thread)

    @store_errors
    def agree_restore(self, readable: list[int], note: str, requested: int | None, error: str | None = None) -> int | None:
        """The newest step every rank can read (or check `requested`); the error names who cannot."""
        n = self._restores
        self._restores += 1
        self.store.set(f"restore/{n}/{self.rank}", json.dumps({"readable": readable, "note": note, "error": error}))
        keys = [f"restore/{n}/{r}" for r in range(self.world_size)]
        self._wait(keys, time.monotonic() + self.timeout_s, "restore: waiting for every rank's list of readable steps", keys_rank=rank_of)
        views = [json.loads(v) for v in self.store.multi_get(keys)]
        failed = {r: v["error"] for r, v in enumerate(views) if v["error"]}
        if failed:
            raise CheckpointError("restore failed on " + "; ".join(f"rank {r}: {e}" for r, e in failed.items()))
        common = set(views[0]["readable"]).intersection(*(v["readable"] for v in views[1:]))
        if requested is not None:
            lacking = [r for r, v in enumerate(views) if requested not in v["readable"]]
            if lacking:
                raise CheckpointError(f"step {requested} cannot be restored: " + _who_cannot(requested, lacking, views))
            return requested
        if common:
            return max(common)
        seen = set().union(*(v["readable"] for v in views))
        if not seen:
            return None
        newest = max(seen)
        lacking = [r for r, v in enumerate(views) if newest not in v["readable"]]
        raise CheckpointError(
            f"no step can be restored on every rank: step {newest} is committed but " + _who_cannot(newest, lacking, views)
            + ". Restore on the ranks' original machines, or configure a remote tier (remote=...) that holds every rank's data"
        )

    @store_errors
    def barrier(self, name: str) -> None:
        self.store.set(f"barrier/{name}/{self.rank}", b"1")
        keys = [f"barrier/{name}/{r}" for r in range(self.world_size)]
        self._wait(keys, time.monotonic() + self.timeout_s, f"waiting for every rank ({name})", keys_rank=rank_of)

    def close(self) -> None:
        """Wait until every rank is done with the store (its server may live in rank 0's process)."""
        try:
            self.barrier("closed")
            self.store.set(f"left/{self.rank}", b"1")
            if self.rank == 0:  # the store's host (with tcp:// init) leaves last
                keys = [f"left/{r}" for r in range(self.world_size)]
                self._wait(keys, time.monotonic() + self.timeout_s, "closing", keys_rank=rank_of)
        except Exception as exc:  # noqa: BLE001 - a dead rank must not stop the others from exiting
            log.warning("checkpointing: rank %d closed without the others: %s", self.rank, exc)

    # ------------------------------------------------------------ helpers

    def _key(self, job: Any, name: str) -> str:
        return f"save/{job.seq}/{name}"

    def _wait(self, keys: list[str], deadline: float, what: str, *, keys_rank: Callable[[str], int]) -> None:
        wait_keys(self.store, keys, deadline, what, keys_rank=keys_rank, timeout_s=self.timeout_s)

    def new_store_client(self) -> Any:
        """Another connection to this manager's key space (for a second background thread)."""
        return _store_client(self.group, self.namespace, self.timeout_s)


def wait_keys(store: Any, keys: list[str], deadline: float, what: str, *, keys_rank: Callable[[str], int], timeout_s: float) -> None:
    """Poll until every key is set; past `deadline`, CoordinationTimeout naming the ranks that did not answer."""
    delay = _POLL_S[0]
    while keys and not store.check(keys):
        if time.monotonic() >= deadline:
            missing = sorted(keys_rank(k) for k in keys if not store.check([k]))
            raise CoordinationTimeout(
                f"{what}: rank(s) {', '.join(map(str, missing))} did not answer in time (timeout_s={timeout_s:g}; "
                "dead, hung, or much slower: raise timeout_s if they are only slow)",
                missing,
            )
        time.sleep(delay)
        delay = min(delay * 2, _POLL_S[1])


def rank_of(key: str) -> int:
    return int(key.rsplit("/", 1)[1])


def _who_cannot(step: int, ranks: list[int], views: list[dict]) -> str:
    return "; ".join(f"rank {r} cannot read it ({views[r]['note']})" for r in ranks)


def _sleep_until(deadline: float, message: str) -> None:
    if time.monotonic() >= deadline:
        raise CoordinationTimeout(message, [0])
    time.sleep(_POLL_S[1] / 5)


_NAMESPACES: dict[str, int] = {}
_NAMESPACE_LOCK = threading.Lock()


def new_namespace(group_name: str) -> str:
    """A store prefix per manager: managers are created in the same order on every rank."""
    with _NAMESPACE_LOCK:
        n = _NAMESPACES.get(group_name, 0)
        _NAMESPACES[group_name] = n + 1
    return f"checkpointing/{group_name}/{n}/"


def _store_client(group: Any, namespace: str, timeout_s: float) -> Any:
    """A store connection of our own, in the job's key space (which is fresh for each launch)."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    clone = getattr(store, "clone", None)  # a separate connection, safe to use from our thread
    if clone is not None:
        store = clone()
    store.set_timeout(datetime.timedelta(seconds=max(timeout_s, 1)))
    return dist.PrefixStore(namespace, store)
