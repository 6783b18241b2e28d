"""One error hierarchy, rooted at CheckpointError. Every message says what went wrong, where, and how to fix it.

Layer: the bottom of the package; imports nothing of it. The storage backends keep their
translation of service errors (storage/retry.py: RemoteStorageError, itself a CheckpointError).

Failures of several ranks read once: `group_by_cause` joins per-rank causes by cause
("ranks 0-1, 3: A; rank 2: B"), with the ranks written by `rank_ranges`. Every place that names
failing or silent ranks in one message uses these two.
"""

from __future__ import annotations

import re
from typing import Iterable, Mapping

_RANK_PLACEHOLDER = "<rank>"


def rank_ranges(ranks: Iterable[int]) -> str:
    """The ranks as a reader takes them in: "rank 2", "ranks 0-3", "ranks 0-1, 3, 5-7" (sorted, each once)."""
    rs = sorted(set(ranks))
    if not rs:
        return "no rank"
    runs: list[tuple[int, int]] = []
    for r in rs:
        if runs and r == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], r)
        else:
            runs.append((r, r))
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return f"rank {text}" if len(rs) == 1 else f"ranks {text}"


def cause_groups(failures: Mapping[int, str]) -> list[tuple[tuple[int, ...], str]]:
    """The ranks that failed for the same cause, each group with that cause, in order of their lowest rank.

    Ranks whose causes are equal form a group. A cause that only one rank gives and that names that
    rank's own number ("rank 2", or a file of its own such as "r00002.<token>.pack") joins the
    others that differ from it only there: the group's cause then says "<rank>" in its place.
    """
    exact: dict[str, list[int]] = {}
    for r in sorted(failures):
        exact.setdefault(failures[r], []).append(r)
    groups: dict[str, list[int]] = {}
    originals: dict[str, str] = {}
    for cause, ranks in exact.items():
        key = _without_own_rank(ranks[0], cause) if len(ranks) == 1 else cause
        groups.setdefault(key, []).extend(ranks)
        originals.setdefault(key, cause)
    out = [(tuple(sorted(rs)), key if len(rs) > 1 else originals[key]) for key, rs in groups.items()]
    return sorted(out, key=lambda group: group[0][0])


def group_by_cause(failures: Mapping[int, str]) -> str:
    """Per-rank causes joined once per cause: "ranks 0-3: X", or "ranks 0-1, 3: A; rank 2: B"."""
    return "; ".join(f"{rank_ranges(ranks)}: {cause}" for ranks, cause in cause_groups(failures))


def _without_own_rank(rank: int, cause: str) -> str:
    """`cause` with the rank's own number, where it names that rank, replaced by "<rank>"."""
    own = re.compile(rf"(?<![0-9A-Za-z])(rank[ _-]?|r)0*{rank}(?![0-9])", re.IGNORECASE)
    return own.sub(lambda m: m.group(1) + _RANK_PLACEHOLDER, cause)


class CheckpointError(Exception):
    """Base class of every error this library raises."""


class CheckpointConfigError(CheckpointError, ValueError):
    """An option or argument is invalid."""


class CheckpointSaveError(CheckpointError):
    """A save failed (in the background or while snapshotting). Nothing was committed for it."""

    def __init__(self, step: int, cause: BaseException | str) -> None:
        self.step = step
        self.cause = cause
        reason = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
        super().__init__(
            f"save of step {step} failed: {reason}. Nothing was committed for step {step}; "
            "earlier committed steps are intact. Fix the cause and save again."
        )


class CheckpointUploadError(CheckpointSaveError):
    """A step committed on the local tier could not be made durable on the remote tier.

    A CheckpointSaveError, so code that handles failed saves handles it too; unlike other save
    errors the step IS committed (locally) and restorable.
    """

    def __init__(self, step: int, remote: str, cause: BaseException | str) -> None:
        self.step = step
        self.cause = cause
        self.remote = remote
        reason = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
        CheckpointError.__init__(
            self,
            f"upload of step {step} to the remote tier {remote} failed: {reason}. Step {step} is committed on the "
            "local tier and restorable from there. A later save tries this upload again before its own, at most 3 times "
            "(one process: once an upload succeeded again, if keep_remote would keep the step; several ranks: the save after "
            "next), and local retention keeps the step until then. A manager started on this directory resumes the upload "
            "of local steps newer than the newest remote one.",
        )


class CheckpointPeerError(CheckpointSaveError):
    """A step committed on the local tier could not be committed on some node's peers.

    `failures`: one line per failed copy (the source node, the peer rank and host, the cause).
    """

    def __init__(self, step: int, failures: list[str]) -> None:
        self.step = step
        self.cause = "; ".join(failures)
        self.failures = list(failures)
        CheckpointError.__init__(
            self,
            f"peer copy of step {step} failed: {self.cause}. Step {step} is committed on the local tier and restorable "
            "from there; the next save copies its own step to the peers again.",
        )



class CheckpointTimeoutError(CheckpointError, TimeoutError):
    """A wait for a save (handle.wait/result/exception, mgr.wait) ran out of its timeout; the save goes on."""


class CheckpointCorruptError(CheckpointError):
    """Stored bytes do not match what the manifest promises (bit rot, truncation, tampering)."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint does not fit the target state: every problem is listed at once."""

    def __init__(self, step: int, problems: list[str], *, load: bool = False, fix: str | None = None) -> None:
        self.step = step
        self.problems = list(problems)
        lines = "\n  - ".join(problem_lines(self.problems))
        if load:  # checkpointing.load(): no target, only the selection and rank asked for
            head, fix_default = "cannot be read as load() was asked", (
                "Name what to read with keys=[...] / exclude=[...] (glob patterns over the keys above: 'model', 'optim/*'), "
                "and rank=r for values each rank saved for itself; `checkpointing inspect PATH` lists what the step holds.")
        else:
            head, fix_default = "does not match the state passed to restore", (
                "Pass the same kinds of objects that were saved, or name what to restore: "
                "restore(..., only=[...]) or exclude=[...] (glob patterns over the keys above: 'model', 'optim/*'; "
                "checkpointing.load(path, keys=...) / exclude=... the same); checkpointing.load(path) shows what the step holds.")
        super().__init__(f"checkpoint step {step} {head} ({len(self.problems)} problem(s)):\n  - {lines}\n{fix or fix_default}")


def about_step(step: int, exc: BaseException | str) -> str:
    """`exc` as a note about `step`: "step N: ...", once (many errors about a step already begin so)."""
    text = str(exc)
    return text if text.startswith(f"step {step}: ") else f"step {step}: {text}"


_RUN_MIN = 4  # sibling keys with one message shown as one line from this many on
_LINES_MAX = 40
_KEYS_MAX = 12  # keys named on one line before the rest are counted


def problem_lines(problems: list[str]) -> list[str]:
    """Problems ("key: what") as lines a reader takes in: keys with the same message on one line from
    _RUN_MIN of them on (in the order they first come, fewer each on its own); a run of sibling keys
    numbered one after the other among them (an RNG state's 624 words) as the first and last key and
    how many; at most _KEYS_MAX names per line (the rest counted in keys) and _LINES_MAX lines (the
    error's `problems` keeps every one)."""
    named: dict[str, list[tuple[str, int]]] = {}  # message -> (a key or a run of keys, how many keys)
    lines: list[str | tuple[str, str]] = []
    i = 0
    while i < len(problems):
        key, sep, what = problems[i].partition(": ")
        j = i + 1
        while sep and j < len(problems) and _next_sibling(problems[j - 1].partition(": ")[0], problems[j], what):
            j += 1
        if not sep:
            lines.append(problems[i])
        else:
            if what not in named:
                named[what] = []
                lines.append(("", what))
            if j - i >= _RUN_MIN:
                parent = key.rpartition("/")[0]
                named[what].append((f"{key} ... {problems[j - 1].partition(': ')[0]} ({j - i} keys under {parent}/)", j - i))
            else:
                named[what].extend((p.partition(": ")[0], 1) for p in problems[i:j])
        i = j
    out: list[str] = []
    for line in lines:
        if isinstance(line, str):
            out.append(line)
        elif len(named[line[1]]) >= _RUN_MIN:
            out.append(f"{_names(named[line[1]])}: {line[1]}")
        else:  # a few: each on its own line, as the key says it
            out.extend(f"{name}: {line[1]}" for name, _ in named[line[1]])
    if len(out) > _LINES_MAX:
        out = out[:_LINES_MAX - 1] + [f"... and {len(out) - _LINES_MAX + 1} more (the error's .problems lists every one)"]
    return out


def _next_sibling(key: str, problem: str, what: str) -> bool:
    """Whether `problem` is about the key numbered one after `key` under the same parent, with message `what`."""
    k, sep, w = problem.partition(": ")
    parent, _, last = key.rpartition("/")
    k_parent, _, k_last = k.rpartition("/")
    return bool(sep and w == what and parent and k_parent == parent and last.isdigit() and k_last.isdigit()
                and int(k_last) == int(last) + 1)


def _names(keys: list[tuple[str, int]]) -> str:
    if len(keys) <= _KEYS_MAX:
        return ", ".join(name for name, _ in keys)
    rest = sum(n for _, n in keys[_KEYS_MAX - 1:])
    return ", ".join(name for name, _ in keys[:_KEYS_MAX - 1]) + f" and {rest} more key{'s' if rest != 1 else ''}"


class CheckpointNotFoundError(CheckpointError, LookupError):
    """A requested step is not committed in the checkpoint directory."""


class ManifestError(CheckpointCorruptError):
    """A manifest or commit marker is malformed, of an unknown version, or unsafe."""


class StateError(CheckpointError, TypeError):
    """The state passed to save() holds something that cannot be checkpointed."""


class RanksFailedError(CheckpointError):
    """A step failed on some ranks; `failures` maps each failing rank to its cause."""

    def __init__(self, step: int, failures: dict[int, str]) -> None:
        self.step = step
        self.failures = dict(sorted(failures.items()))
        n = len(self.failures)
        super().__init__(f"step {step} failed on {n} rank{'s' if n != 1 else ''}: {group_by_cause(self.failures)}")


class CoordinationTimeout(CheckpointError):
    """A rank did not answer in time: it died, hangs, or is far slower than the others."""

    def __init__(self, message: str, ranks: list[int] | None = None) -> None:
        super().__init__(message)
        self.ranks = ranks or []  # the ranks that did not answer


class CoordinationLost(CheckpointError):
    """The torch.distributed store is unreachable (its host process is gone)."""


class PeerFailed(CheckpointError):
    """Another rank reported that its part of the step failed (this rank stops waiting for it)."""

    def __init__(self, rank: int) -> None:
        super().__init__(f"rank {rank} failed")
        self.peer = rank


class UploadRanksFailed(CheckpointError):
    """The remote commit of a step was refused because some ranks failed; `failures` maps rank -> cause."""

    def __init__(self, failures: dict[int, str]) -> None:
        self.failures = dict(sorted(failures.items()))
        n = len(self.failures)
        super().__init__(f"{n} rank{'s' if n != 1 else ''} failed: {group_by_cause(self.failures)}")


class MergeError(CheckpointError):
    """The ranks' reports of one save do not form one consistent manifest; `problems` lists why."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("; ".join(problems[:20]) + (f"; and {len(problems) - 20} more" if len(problems) > 20 else ""))


class CommitConflictError(CheckpointError):
    """Another writer committed the same step on a tier first (its COMMIT names another manifest)."""


class DirectoryLockedError(CheckpointError):
    """Another process holds the writer lock of a local checkpoint directory (tier/lock.py)."""
