"""Peer copies as decisions: which nodes hold each node's copies, and what a node fetches back after a loss (pure).

A *node* is a local tier: the ranks that share one local directory (one TIER id). Nodes are named
by their leader rank (the lowest rank of the tier), which stays the same when a machine is
replaced and its ranks start again on a fresh disk (its TIER id does not).

`place(nodes, copies)` puts node i's copies on the `copies` nodes that follow it in the sorted list
(ring offsets 1..copies). So no node holds a copy of itself, every node holds exactly `copies`
others' copies (the load is even), and the copies of one node's data sit on `copies` distinct
other nodes: any `copies` nodes may be lost together and every node's data still has a copy
somewhere (its own disk, or one of its peers). With fewer than `copies + 1` nodes there is no such
placement: `check_nodes` says so and how to fix it.

`fetch_plan` is the restore side: a node whose local tier lacks the step the ranks will restore (the
newest every node can read from somewhere) fetches it back from a peer that holds a replica its own
ranks wrote (at this world size), trying each such host.
"""

from __future__ import annotations

import dataclasses
from typing import Collection, Mapping, Sequence

from checkpointing.errors import CheckpointConfigError


def check_nodes(nodes: Sequence[int], copies: int, *, where: str = "") -> None:
    """CheckpointConfigError unless `copies` peer copies fit `nodes` (distinct, at least copies + 1)."""
    if isinstance(copies, bool) or not isinstance(copies, int) or copies < 0:
        raise CheckpointConfigError(f"peer_copies={copies!r} is invalid: pass a whole number >= 0 (0: no peer copies)")
    if len(set(nodes)) != len(nodes):
        raise CheckpointConfigError(f"the node list {list(nodes)} names a node twice")
    if copies and len(nodes) < copies + 1:
        raise CheckpointConfigError(
            f"peer_copies={copies} needs at least {copies + 1} nodes (local tiers), and this job has {len(nodes)}{where}: "
            "ranks that pass the same local_dir (the same TIER id) are one node, and a node never holds its own copy. "
            f"Lower peer_copies to {max(0, len(nodes) - 1)} or give each node its own node-local directory"
        )


def place(nodes: Sequence[int], copies: int) -> dict[int, tuple[int, ...]]:
    """Each node -> the nodes that hold its copies, in order of preference (ring offsets 1..copies
    in the sorted node list)."""
    order = sorted(nodes)
    check_nodes(order, copies)
    n = len(order)
    return {node: tuple(order[(i + d) % n] for d in range(1, copies + 1)) for i, node in enumerate(order)}


def hosted_by(placement: Mapping[int, Sequence[int]]) -> dict[int, tuple[int, ...]]:
    """The inverse of `place`: each node -> the nodes whose copies it holds (sorted)."""
    out: dict[int, list[int]] = {node: [] for node in placement}
    for source, hosts in placement.items():
        for host in hosts:
            out.setdefault(host, []).append(source)
    return {host: tuple(sorted(sources)) for host, sources in out.items()}


@dataclasses.dataclass(frozen=True)
class Hosted:
    """A replica one node holds: the source tier's id, the ranks that wrote to that tier and the
    world size then, and the steps committed in it."""

    host: int  # the leader rank of the node holding it
    tier: str
    ranks: tuple[int, ...]
    world_size: int
    steps: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Fetch:
    """Fetch the replica of `tier`, `step`, from the first of `hosts` that answers."""

    tier: str
    step: int
    hosts: tuple[int, ...]


def fetch_plan(me: int, nodes: Mapping[int, Collection[int]], world_size: int, *, local: Mapping[int, Collection[int]],
               hosted: Sequence[Hosted], remote: Collection[int] = (), requested: int | None = None) -> list[Fetch]:
    """What node `me` fetches back before a restore, in order of preference: the fetcher takes the first
    that arrives whole. First the step the ranks will restore (`requested`, else the newest step every
    node can read: on its local tier, in a replica its own ranks wrote at this world size, wherever that
    replica is, or on the remote tier), when `me` holds it neither on its local tier nor in a replica on
    its own disk; with the hosts that hold a replica of it, in rank order. Then, with `requested` None,
    should that copy arrive damaged, the next older step every node can read, and so on, until a step
    `me` holds already or the remote tier holds (restore reads that one from there). `nodes`: leader
    rank -> its ranks; `local`: leader rank -> steps committed on its local tier. Only what the restore
    reads travels: a lost node's disk should not fill with replicas of older steps nobody asked for
    (restore(step=k) of another step fetches that one)."""
    def own(leader: int) -> list[Hosted]:
        ranks = tuple(sorted(nodes[leader]))
        return [h for h in hosted if h.ranks == ranks and h.world_size == world_size]

    readable = {leader: set(local.get(leader, ())) | set(remote) | {s for h in own(leader) for s in h.steps} for leader in nodes}
    common = set.intersection(*readable.values()) if readable else set()
    newest = requested if requested is not None else max(common, default=None)
    candidates = [] if newest is None else [newest] if requested is not None else sorted((s for s in common if s <= newest), reverse=True)
    plan = []
    for step in candidates:
        if step in local.get(me, ()) or any(h.host == me and step in h.steps for h in own(me)):
            break  # readable here: nothing older is needed
        by_tier: dict[str, list[int]] = {}
        for h in own(me):
            if h.host != me and step in h.steps:
                by_tier.setdefault(h.tier, []).append(h.host)
        plan += [Fetch(tier, step, tuple(sorted(set(hosts)))) for tier, hosts in sorted(by_tier.items())][:1]
        if step in remote:
            break  # if its copy does not arrive, restore reads it from the remote tier
    return plan
