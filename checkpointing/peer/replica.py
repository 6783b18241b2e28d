"""Replicas on disk: the peer area of a local tier, one directory per source node (layer: peer; I/O).

    <local_dir>/peers/<source tier id>/      the replica of another node's local tier
        TIER                                  that node's tier id: the directory reads as its local tier
        SOURCE.json                           {"format_version":3,"ranks":[...],"tier":...,"world_size":N}
        step-0000000010/r00002.<token>.pack   the step's files on that tier (files[].tier == id), same names
        step-0000000010/manifest.<token>.json the step's manifest, the same bytes as everywhere
        step-0000000010/COMMIT                written last, by the host, once the data is durable

A replica directory has the layout of a tier (docs/format.md, "Peer copies"), so listing,
retention, delete and the reference-safe collection (tier/collect.py, with its pins) work on it
unchanged, and a step in it without COMMIT is invisible like any incomplete step. This module
owns the directory: which replicas a node holds, their sources, tidying at start, retention after
each replica commits (the source's keep_local), `delete`, and dropping replicas of nodes this node
no longer holds copies for. Only the writing process of the local tier (its leader rank, under the
writer lock) changes it; `lock(tier)` serialises this process's writers of one replica.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from pathlib import Path
from typing import Collection

from checkpointing.errors import CheckpointError, ManifestError
from checkpointing.format.manifest import FORMAT_VERSION, canonical_json
from checkpointing.plan.peers import Hosted
from checkpointing.plan.retention import RetentionPolicy, StepInfo, as_policy, steps_to_delete
from checkpointing.storage import LocalStorage
from checkpointing.tier import catalog, collect
from checkpointing.tier.opening import ReadOnlyLocalStorage
from checkpointing.tier.tierfile import TIER_FILE, read_tier_id

log = logging.getLogger("checkpointing")

PEERS_DIR = "peers"
SOURCE_NAME = "SOURCE.json"
_TIER_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def check_tier_id(tier: object) -> str:
    """A source tier id from the wire or the disk: it names a directory, so it must be plain."""
    if not isinstance(tier, str) or not _TIER_ID.fullmatch(tier):
        raise ManifestError(f"{tier!r} is not a tier id (1-64 of A-Z a-z 0-9 _ -)")
    return tier


class ReplicaArea:
    """The replicas a node holds under `<local tier>/peers/`. `tier` is the local tier's storage
    (it creates the directories, fsynced in their parents); `read_only`: only look."""

    def __init__(self, tier: LocalStorage, *, read_only: bool = False) -> None:
        self._tier, self.read_only = tier, read_only
        self.root = Path(tier.root, PEERS_DIR)
        self._opened: dict[str, LocalStorage] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def tiers(self) -> list[str]:
        """The source tiers this node holds a replica directory of."""
        return [name for name in self._tier.list(PEERS_DIR) if _TIER_ID.fullmatch(name)]

    def storage(self, tier: str) -> LocalStorage:
        """The replica of `tier` as a storage (created, with its TIER file, when this node may write)."""
        check_tier_id(tier)
        with self._guard:
            found = self._opened.get(tier)
            if found is not None:
                return found
            path = f"{PEERS_DIR}/{tier}"
            if self.read_only:
                opened: LocalStorage = ReadOnlyLocalStorage(self.root / tier)
            else:
                self._tier.makedirs(path)
                opened = LocalStorage(self.root / tier, direct=self._tier.direct, fsync=self._tier.fsync, create=False)
                if read_tier_id(opened) is None:
                    try:
                        opened.put(TIER_FILE, tier.encode("ascii"), exclusive=True)
                    except FileExistsError:  # another rank of this node created it first
                        pass
            self._opened[tier] = opened
            return opened

    def lock(self, tier: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(tier, threading.Lock())

    def committed(self, tier: str) -> list[int]:
        return catalog.list_steps(self.storage(tier)).committed if tier in self.tiers() else []

    def source(self, tier: str) -> tuple[tuple[int, ...], int] | None:
        """The ranks that wrote to `tier` and their world size, as the source said (None: unknown)."""
        try:
            obj = json.loads(self.storage(tier).get(SOURCE_NAME, max_bytes=1 << 20))
            return tuple(int(r) for r in obj["ranks"]), int(obj["world_size"])
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            return None

    def set_source(self, tier: str, ranks: Collection[int], world_size: int) -> None:
        ranks = tuple(sorted(ranks))
        if self.source(tier) != (ranks, world_size):
            body = {"format_version": FORMAT_VERSION, "ranks": list(ranks), "tier": tier, "world_size": world_size}
            self.storage(tier).put(SOURCE_NAME, canonical_json(body))

    def inventory(self, host: int) -> list[Hosted]:
        """What this node (leader rank `host`) holds, for a restore's fetch plan."""
        out = []
        for tier in self.tiers():
            source = self.source(tier)
            steps = self.committed(tier)
            if source is not None and steps:
                out.append(Hosted(host, tier, source[0], source[1], tuple(steps)))
        return out

    def storages(self) -> dict[str, LocalStorage]:
        """Every replica this node holds, by source tier (what a restore may read)."""
        return {tier: self.storage(tier) for tier in self.tiers()}

    def tidy(self) -> None:
        """A writer's start: remove the replicas whose copy did not commit (a host or sender that died)."""
        for tier in self.tiers():
            collect.remove_incomplete(self.storage(tier))

    def retain(self, tier: str, keep: RetentionPolicy | None, newest: int) -> None:
        """The source's keep_local on its replica, after `newest` committed there."""
        storage = self.storage(tier)
        collect.apply_retention(storage, keep, protect={newest}, where=f"on the peer copy {storage.url}")

    def drop_stale(self, keep: Collection[str], newer_than: int, policy: int | RetentionPolicy | None) -> list[str]:
        """Retire the steps of the replicas of tiers not in `keep` (a replaced node's, or one this node no
        longer holds copies for) whose steps are all older than `newer_than`, which just committed here
        from a node this node does hold copies for, as far as the sources' keep_local (`policy`) over
        their steps and the newer ones of the replicas in `keep` lets go (a replaced node's older steps
        stay until its new tier holds as many); a replica left without steps goes whole. COMMITs first
        (collect), then the directory."""
        dropped = []
        for tier in self.tiers():
            if tier in keep:
                continue
            steps = self.committed(tier)
            if steps and max(steps) >= newer_than:
                continue
            storage = self.storage(tier)
            retire = self._unkept(storage, steps, keep, policy)
            try:
                with self.lock(tier):
                    collect.collect(storage, retire=retire)
                    if len(retire) < len(steps):
                        continue
                    self._tier.delete(f"{PEERS_DIR}/{tier}")
            except (OSError, CheckpointError) as exc:
                log.warning("checkpointing: could not remove the stale peer copy %s: %s", storage.url, exc)
                continue
            with self._guard:
                self._opened.pop(tier, None)
            dropped.append(tier)
            log.info("checkpointing: removed the peer copy %s (steps %s): its node is no source of this node any more", storage.url, steps)
        return dropped

    def _unkept(self, storage: LocalStorage, steps: list[int], keep: Collection[str], policy: int | RetentionPolicy | None) -> list[int]:
        """`steps` of a stale replica that `policy` does not keep among them and the newer steps held for `keep`."""
        rule = as_policy(policy)
        if rule is None or not steps:
            return [] if rule is None else steps
        metrics = bool(rule.metric_names)
        newer: dict[int, StepInfo] = {}
        for tier in set(keep) & set(self.tiers()):
            held = [s for s in self.committed(tier) if s > max(steps) and s not in newer]
            newer.update((i.step, i) for i in catalog.step_infos(self.storage(tier), held, metrics=metrics))
        infos = catalog.step_infos(storage, steps, metrics=metrics) + list(newer.values())
        return [s for s in steps_to_delete(infos, rule) if s in set(steps)]

    def delete_step(self, step: int) -> list[str]:
        """mgr.delete(step) here: the step off every replica this node holds (reference-safe)."""
        done = []
        for tier in self.tiers():
            storage = self.storage(tier)
            with self.lock(tier):
                if step in catalog.list_steps(storage).committed:
                    collect.delete_committed(storage, step)
                    done.append(storage.url)
        return done
