"""Committing a step across ranks through the torch.distributed store (I/O; the merge is pure).

The background writer of each rank talks only to the key-value store (its own TCPStore client,
never a collective on the training process group), so training never waits on another rank's disk.
Per save (numbered `seq`, the same on every rank; the keys are built in keys.py):

    save/<seq>/ws/<rank>    what replicated tensors this rank writes (its local-tier peers skip those bytes)
    save/<seq>/part/<rank>  its report after writing and fsyncing (rank_reports.RankPart), or its error
    save/<seq>/manifest     rank 0's merged manifest, with rank 0's save() metrics (or nothing, if the step failed);
                            zlib-compressed when other local tiers' leaders read it
    save/<seq>/committed/<rank>  with it, the step's digest and the files that rank wrote (format: CommittedStep.by_rank):
                            all that a rank which commits on no tier keeps of the step, so it neither reads nor
                            decodes the manifest (and no rank reads the whole file table: O(N), not O(N^2))
    save/<seq>/ack/<rank>   each local tier's leader wrote manifest + COMMIT there, or its error
    save/<seq>/status       rank 0's verdict: committed, or which ranks failed and why

Every wait polls with a deadline (timeout_s) and names the ranks that did not answer (store.py).
Whether this rank already told its peers what it writes in a save is kept here, by the save's seq.
"""

from __future__ import annotations

import json
import logging
import time
import zlib
from typing import TYPE_CHECKING, Any, Callable

from checkpointing.dist import keys
from checkpointing.dist.remote_commit import StoreTierCommitter
from checkpointing.dist.restore_agreement import RestoreView, agreed_step
from checkpointing.dist.store import connect, delete_keys, poll, store_errors, wait_keys, wait_reports
from checkpointing.dist.types import SaveRef, Store, TierCommitter, Written
from checkpointing.errors import CheckpointError, CoordinationTimeout, MergeError, PeerFailed, RanksFailedError, group_by_cause
from checkpointing.format.decode import decode_committed_step
from checkpointing.format.gcpause import gc_paused
from checkpointing.format.handoff import handoff
from checkpointing.format.manifest import CommittedStep, Manifest, encode_committed_step, manifest_digest
from checkpointing.format.rank_reports import RankPart, encode_part, merge_parts, part_from
from checkpointing.storage import LocalStorage, Storage
from checkpointing.tier import catalog
from checkpointing.tier.identity import ensure_tier_id

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

log = logging.getLogger("checkpointing")


class StoreCoordinator:
    """Many ranks: parts, manifest and verdict travel through the store; rank 0 merges."""

    def __init__(self, storage: LocalStorage, group: ProcessGroup, *, timeout_s: float, namespace: str,
                 joining: str = "starting the checkpoint manager") -> None:
        import torch.distributed as dist

        self.storage = storage
        self.timeout_s = timeout_s
        self.namespace = namespace
        self.rank: int = dist.get_rank(group)
        self.world_size: int = dist.get_world_size(group)
        self.store = connect(namespace, timeout_s)
        self._restores = 0
        self.per_rank_keys: frozenset[str] = frozenset()
        self._per_rank_pending: list[str] = []
        self._merged: tuple[int, Manifest, bytes] | None = None  # rank 0: the save (seq) it merged last, its manifest decoded and encoded
        self._shared: set[int] = set()  # the seqs of the saves whose ws/<rank> this rank has set
        # which ranks share a local tier: every rank publishes the id found in its directory
        self.store.set(keys.init_tier(self.rank), ensure_tier_id(storage))
        tier_keys = [keys.init_tier(r) for r in range(self.world_size)]
        self._wait(tier_keys, time.monotonic() + timeout_s, joining)
        self.tiers = tuple(v.decode("ascii") for v in self.store.multi_get(tier_keys))
        self.leader = self.rank == min(r for r in range(self.world_size) if self.tiers[r] == self.tiers[self.rank])
        self.leaders = sorted({min(r for r in range(self.world_size) if self.tiers[r] == t) for t in self.tiers})

    # ------------------------------------------------------------ during a save (background thread)

    @store_errors
    def share_written(self, save: SaveRef, written: list[Written]) -> None:
        payload = [[k, None if o is None else list(o), d] for k, o, d in written]
        self.store.set(keys.save_written(save.seq, self.rank), json.dumps({"ok": True, "written": payload}))
        self._shared.add(save.seq)

    @store_errors
    def peer_written(self, save: SaveRef) -> set[Written]:
        peers = [r for r in range(self.world_size) if r != self.rank and self.tiers[r] == self.tiers[self.rank]]
        peer_keys = [keys.save_written(save.seq, r) for r in peers]
        self._wait(peer_keys, time.monotonic() + self.timeout_s, f"step {save.step}: waiting for local-tier peers")
        out: set[Written] = set()
        for r, raw in zip(peers, self.store.multi_get(peer_keys) if peer_keys else []):
            msg = json.loads(raw)
            if not msg["ok"]:
                raise PeerFailed(r)
            out.update(Written(k, None if o is None else tuple(o), d) for k, o, d in msg["written"])
        return out

    @store_errors
    def fail(self, save: SaveRef, error: BaseException) -> None:
        """This rank's part of the save failed: tell the others now (so nobody waits for a timeout),
        then, with several ranks, wait for rank 0's verdict: RanksFailedError names every failing rank."""
        try:
            self._report_failure(save, error)
            if self.world_size > 1:  # rank 0 still coordinates; every rank waits for the verdict
                self._finish(save)
        finally:
            self._shared.discard(save.seq)

    @store_errors
    def commit(self, save: SaveRef, part: RankPart) -> CommittedStep:
        """Report this rank's part; rank 0 merges; every tier's leader commits there. Raises if any rank failed."""
        try:
            self.store.set(keys.save_part(save.seq, self.rank), encode_part(part))
            return self._finish(save)
        finally:
            self._shared.discard(save.seq)

    def _report_failure(self, save: SaveRef, error: BaseException) -> None:
        cause = "aborted because another rank failed" if isinstance(error, PeerFailed) else f"{type(error).__name__}: {error}"
        try:
            if save.seq not in self._shared:
                self.store.set(keys.save_written(save.seq, self.rank), json.dumps({"ok": False}))
                self._shared.add(save.seq)
            if isinstance(error, CoordinationTimeout) and error.ranks:  # rank 0 waits no longer for them (store.wait_reports)
                self.store.set(keys.save_silent(save.seq, self.rank), json.dumps({"ranks": sorted(error.ranks), "error": cause}))
            report = {"ok": False, "error": cause, "root": not isinstance(error, PeerFailed)}
            self.store.set(keys.save_part(save.seq, self.rank), json.dumps(report))
        except Exception as exc:  # noqa: BLE001 - the store is gone too: the others will time out
            log.warning("checkpointing: could not report rank %d's failure of step %d: %s", self.rank, save.step, exc)

    def _finish(self, save: SaveRef) -> CommittedStep:
        deadline = time.monotonic() + self.timeout_s
        merged = self.rank == 0 and self._merge(save, deadline)
        # rank 0 may spend timeout_s on the reports and again on the tiers' commits: others wait longer
        later = deadline + self.timeout_s
        committed = None
        if self.leader:
            committed = self._commit_tier(save, deadline if self.rank == 0 else later)
        if merged:
            self._collect_acks(save, later)
        status = self._status(save, later + self.timeout_s)
        if not status["ok"]:
            raise RanksFailedError(save.step, {int(r): c for r, c in status["failures"].items()})
        self.per_rank_keys = frozenset(status["per_rank_keys"])
        if committed is None:  # committed by its tier's leader: this rank's account of it from rank 0 (not the manifest: see keys.save_committed)
            committed = decode_committed_step(self.store.get(keys.save_committed(save.seq, self.rank)), f"rank 0's account of step {save.step}")
            if committed.step != save.step:
                raise CheckpointError(f"step {save.step}: rank 0 reported committing step {committed.step} in its place (two jobs in one store?)")
        return committed

    def _merge(self, save: SaveRef, deadline: float) -> bool:
        """Rank 0: merge every rank's part and publish the manifest; False if the step already failed."""
        part_keys = [keys.save_part(save.seq, r) for r in range(self.world_size)]
        try:
            silent = wait_reports(self.store, part_keys, [keys.save_silent(save.seq, r) for r in range(self.world_size)], deadline,
                                  f"step {save.step}: waiting for every rank's report", timeout_s=self.timeout_s)
        except CoordinationTimeout as exc:
            silent = {r: str(exc) for r in exc.ranks}
        if silent:  # dead or hung: the save fails, naming them
            self._verdict(save, silent)
            return False
        if save.seq > 0:  # every rank reported this save, so all are done with the previous one
            self._delete_seq(save.seq - 1)
        failures: dict[int, str] = {}
        roots: dict[int, str] = {}
        parts = []
        with gc_paused():  # the reports parsed, merged, encoded and decoded: a burst of objects (gcpause.py)
            for r, data in enumerate(self.store.multi_get(part_keys)):
                handoff()  # a report per rank parsed here, on a background thread: format/handoff.py
                msg = json.loads(data)
                if msg.get("ok") is False:
                    (roots if msg.get("root") else failures)[r] = msg["error"]
                else:
                    parts.append(part_from(msg))
            merged = None
            if not (roots or failures):
                try:
                    merged = merge_parts(save.step, parts, self.tiers, save.metrics)  # rank 0's metrics
                except MergeError as exc:
                    roots = {0: f"the ranks' reports do not form a consistent checkpoint: {exc}"}
        if merged is None:
            self._verdict(save, roots or failures)
            return False
        manifest, data, per_rank = merged
        self._per_rank_pending = sorted(per_rank)
        self._merged = (save.seq, manifest, data)
        # every other local tier's leader fetches it from rank 0's store: compressed, as the file table and
        # the chunk references repeat themselves (a 10 MB manifest: 2 MB, 60-80 ms of zlib outside the GIL)
        self.store.set(keys.save_manifest(save.seq), zlib.compress(data, 1) if len(self.leaders) > 1 else data)
        accounts = CommittedStep.of(manifest, manifest_digest(data)).by_rank()
        self.store.multi_set([keys.save_committed(save.seq, r) for r in range(self.world_size)], [encode_committed_step(a) for a in accounts])
        return True

    def _collect_acks(self, save: SaveRef, deadline: float) -> None:
        """Rank 0: wait for every local tier's commit, then give the verdict."""
        acks = [keys.save_ack(save.seq, r) for r in self.leaders]
        try:
            self._wait(acks, deadline, f"step {save.step}: waiting for each local tier's commit")
        except CoordinationTimeout as exc:
            return self._verdict(save, {r: str(exc) for r in exc.ranks})
        failures = {r: m["error"] for r, m in zip(self.leaders, map(json.loads, self.store.multi_get(acks))) if not m["ok"]}
        self._verdict(save, failures, per_rank=self._per_rank_pending)

    def _verdict(self, save: SaveRef, failures: dict[int, str], per_rank: list[str] | None = None) -> None:
        status = {"ok": not failures, "failures": {str(r): c for r, c in failures.items()}, "per_rank_keys": per_rank or []}
        self.store.set(keys.save_status(save.seq), json.dumps(status))

    def _commit_tier(self, save: SaveRef, deadline: float) -> CommittedStep | None:
        """A local tier's leader: commit rank 0's manifest there and acknowledge (None: the step failed)."""
        manifest_key, status_key = keys.save_manifest(save.seq), keys.save_status(save.seq)

        def published() -> str | None:
            if self.store.check([manifest_key]):
                return manifest_key
            return status_key if self.store.check([status_key]) else None

        found = poll(published, deadline)
        if found is None:
            raise CoordinationTimeout(f"step {save.step}: rank 0 (the coordinator) published no manifest in time; it may have died", [0])
        if found == status_key:
            return None  # rank 0 gave its verdict without a manifest: the step failed
        mine = self._merged if self._merged is not None and self._merged[0] == save.seq else None  # rank 0 has it, decoded too
        published = None if mine is not None else self.store.get(manifest_key)
        decoded = mine[1] if mine is not None else None
        data, digest = b"", ""
        try:
            data = mine[2] if mine is not None else zlib.decompress(published)  # a leader other than rank 0: compressed (_merge)
            with gc_paused():  # another rank's leader decodes the manifest here (gcpause.py)
                digest = catalog.commit_bytes(self.storage, save.step, data, save.token, decoded)
            ack: dict[str, Any] = {"ok": True}
        except Exception as exc:  # noqa: BLE001 - reported to rank 0, which fails the step everywhere
            ack = {"ok": False, "error": f"committing on its local tier {self.storage.url}: {type(exc).__name__}: {exc}"}
        self.store.set(keys.save_ack(save.seq, self.rank), json.dumps(ack))
        return CommittedStep.of(catalog.decoded_manifest(data, f"step {save.step} manifest", digest), digest) if ack["ok"] else None

    def _status(self, save: SaveRef, deadline: float) -> dict[str, Any]:
        key = keys.save_status(save.seq)
        self._wait([key], deadline, f"step {save.step}: waiting for rank 0's verdict", keys_rank=lambda k: 0)
        return json.loads(self.store.get(key))

    def _delete_seq(self, seq: int) -> None:
        delete_keys(self.store, keys.save_all(seq, self.world_size))

    # ------------------------------------------------------------ collective calls (training thread)

    @store_errors
    def agree_restore(self, readable: list[int], note: str, requested: int | None, error: str | None = None) -> int | None:
        """The newest step every rank can read (or check `requested`); the error names who cannot."""
        n = self._restores
        self._restores += 1
        self.store.set(keys.restore(n, self.rank), json.dumps({"readable": readable, "note": note, "error": error, "requested": requested}))
        view_keys = [keys.restore(n, r) for r in range(self.world_size)]
        self._wait(view_keys, time.monotonic() + self.timeout_s, "restore: waiting for every rank's list of readable steps")
        return agreed_step([RestoreView(**json.loads(v)) for v in self.store.multi_get(view_keys)], requested)

    @store_errors
    def gather(self, name: str, value: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's `value`, indexed by rank."""
        self.store.set(keys.gather(name, self.rank), json.dumps(value))
        gather_keys = [keys.gather(name, r) for r in range(self.world_size)]
        self._wait(gather_keys, time.monotonic() + self.timeout_s, f"gathering every rank's {name}")
        return [json.loads(v) for v in self.store.multi_get(gather_keys)]

    def barrier(self, name: str, error: str | None = None) -> None:
        failed = self.errors_at(name, error)
        if failed:
            raise CheckpointError(group_by_cause(failed))

    @store_errors
    def errors_at(self, name: str, error: str | None = None) -> dict[int, str]:
        self.store.set(keys.barrier(name, self.rank), b"1" if error is None else ("!" + error).encode())
        arrived = [keys.barrier(name, r) for r in range(self.world_size)]
        self._wait(arrived, time.monotonic() + self.timeout_s, f"waiting for every rank ({name})")
        return {r: v[1:].decode("utf-8", "replace") for r, v in enumerate(self.store.multi_get(arrived)) if v.startswith(b"!")}

    def close(self) -> None:
        """Wait until every rank is done with the store (its server may live in rank 0's process)."""
        try:
            self.barrier("closed")
            self.store.set(keys.left(self.rank), b"1")
            if self.rank == 0:  # the store's host (with tcp:// init) leaves last
                gone = [keys.left(r) for r in range(self.world_size)]
                self._wait(gone, time.monotonic() + self.timeout_s, "closing")
        except Exception as exc:  # noqa: BLE001 - a dead rank must not stop the others from exiting
            log.warning("checkpointing: rank %d closed without the others: %s", self.rank, exc)

    # ------------------------------------------------------------ connections

    def remote_committer(self, local: Storage, remote: Storage) -> TierCommitter:
        return StoreTierCommitter(self, local, remote)

    def new_store_client(self) -> Store:
        """Another connection to this manager's key space (for a second background thread)."""
        return connect(self.namespace, self.timeout_s)

    def _wait(self, waited: list[str], deadline: float, what: str, *, keys_rank: Callable[[str], int] = keys.rank_of) -> None:
        wait_keys(self.store, waited, deadline, what, timeout_s=self.timeout_s, keys_rank=keys_rank)
