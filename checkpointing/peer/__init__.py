"""Peer copies: each node's committed steps also committed on other nodes' local tiers (docs/design.md, "Peer copies").

Layer: orchestration, a sibling of save/ and restore/ (none of the three imports another); the
manager composes them. May import: dist, tier, storage, options, plan, format, errors.
Internal: nothing here is public API.

Modules, bottom up: types.py (errors, PeerJob, results), wire.py (framing on the socket),
replica.py (replicas on disk: the peer area of a local tier), transfer.py (one replica over one
connection: offer, need, files, verify, commit), server.py (the node leader's listener and its
clients: push, pull, list), copies.py (the copy thread: each save to the node's peers, every
rank hearing every node's outcome through the store), recovery.py (before a restore: fetch back
what a replaced node lost), node.py (the facade the manager holds: start-up, placement, addresses).
"""

__all__: list[str] = []
