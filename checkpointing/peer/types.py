"""What the peer-copy room hands around: its errors, a save's peer job, per-node outcomes (layer: peer).

`PeerJob` is one save's way to the peers as the training thread sees it (SaveHandle.wait, mgr.wait,
the next save()): the copy thread (copies.py) fills in the outcome and sets `done` last. Its error is
raised once, like an upload's (save/job.py).

`CheckpointPeerError` is a CheckpointSaveError whose step IS committed (locally, and remotely if
configured): like CheckpointUploadError, code that handles failed saves handles it too.
(It belongs in checkpointing/errors.py beside CheckpointUploadError; it lives here until that file
is free to change.)
"""

from __future__ import annotations

import dataclasses
import threading

from checkpointing.errors import CheckpointError, CheckpointPeerError, rank_ranges  # noqa: F401 - CheckpointPeerError: re-exported


class PeerLinkError(CheckpointError):
    """A connection to a peer failed: refused, reset, timed out, or spoke something else."""


@dataclasses.dataclass(frozen=True)
class CopyResult:
    """One node's copies of a step: what its leader sent and what the peers held already."""

    node: int  # the node's leader rank
    peers: tuple[int, ...]  # the leader ranks of the peers that committed the copy
    bytes_sent: int  # to all of them together
    bytes_reused: int  # files a peer held already (earlier steps' files an incremental step references)
    seconds: float


def node_name(ranks: tuple[int, ...] | list[int], where: str = "") -> str:
    """A node as messages name it: 'the node of ranks 0-1 (/nvme/ckpt)'."""
    return f"the node of {rank_ranges(ranks)}" + (f" ({where})" if where else "")


class PeerJob:
    """One save's peer copies. `done` is set once every node's copies are committed (or failed, or
    there was nothing to copy: the save itself failed); `error` is then a CheckpointPeerError."""

    def __init__(self, seq: int, step: int) -> None:
        self.seq, self.step = seq, step
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.error_reported = False
        self.results: tuple[CopyResult, ...] = ()  # per node, once done without error

    @property
    def bytes_sent(self) -> int:
        return sum(r.bytes_sent for r in self.results)

    @property
    def bytes_reused(self) -> int:
        return sum(r.bytes_reused for r in self.results)

    def finish(self, error: BaseException | None, results: tuple[CopyResult, ...] = ()) -> None:
        self.error, self.results = error, results
        self.done.set()

    def raise_error(self) -> None:
        """Raise the copies' error, once."""
        if self.error is not None and not self.error_reported:
            self.error_reported = True
            raise self.error

    def __repr__(self) -> str:
        return f"PeerJob(step={self.step}, seq={self.seq}, done={self.done.is_set()})"
