"""Names of things on disk (pure). The same layout on every tier; see docs/format.md.

    <root>/step-0000000010/r00000.<token>.pack    data written by rank 0 for step 10
    <root>/step-0000000010/manifest.<token>.json   canonical JSON manifest
    <root>/step-0000000010/COMMIT                  commit marker, written last
    <root>/metrics.jsonl                            one JSON line per save (+1 per later try of a failed upload)
    <root>/spares/<token>.pack                      a retired pack file kept to be written over by the next save
"""

from __future__ import annotations

import re
import secrets

from checkpointing.errors import CheckpointConfigError, ManifestError

STEP_PREFIX = "step-"
STEP_DIGITS = 10
COMMIT_NAME = "COMMIT"
METRICS_NAME = "metrics.jsonl"
MAX_STEP = 10**STEP_DIGITS - 1

SPARES_DIR = "spares"  # local tier only: retired pack files the next saves write over (docs/format.md)

_STEP_DIR = re.compile(r"^step-(\d{10})$")
_PACK = re.compile(r"^r\d{5}\.[0-9a-f]+\.pack$")
_SPARE = re.compile(r"^[0-9a-f]+\.pack$")
_IN_STEP = re.compile(r"^(?:r\d{5}\.[\w-]+\.pack|manifest\.[\w-]+\.json|COMMIT|PIN\.r\d{5}\.[\w-]+\.json)(?:\.tmp-[\w-]+)?$", re.ASCII)
_SEGMENT = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")


def check_step(step: object, *, optional: bool = False) -> int:
    """A step number a caller passed (save(), step marks; restore(): None too when `optional`): an int in
    0..MAX_STEP, else CheckpointConfigError."""
    if optional and step is None:
        return step  # type: ignore[return-value]
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise CheckpointConfigError(f"step={step!r} is invalid: pass an int in 0..{MAX_STEP}")
    return step


def step_dir(step: int) -> str:
    if not (0 <= step <= MAX_STEP):
        raise ValueError(f"step {step} is outside 0..{MAX_STEP}")
    return f"{STEP_PREFIX}{step:0{STEP_DIGITS}d}"


def parse_step_dir(name: str) -> int | None:
    m = _STEP_DIR.fullmatch(name)
    return int(m.group(1)) if m else None


def borrowed_hint(step: int, path: str) -> str:
    """For an error about a missing file of `step`: when it lies in another step's directory (an
    incremental save borrows chunks from earlier steps' files), what that means and how to fix it."""
    owner = parse_step_dir(path.split("/", 1)[0])
    if owner is None or owner == step:
        return ""
    return (f" (step {step} borrows it from step {owner}'s directory: an incremental save writes only what changed, so a "
            "step's directory alone is not a whole checkpoint; copy the whole checkpoint directory, or make a "
            "self-contained copy with `checkpointing export`)")


def new_token() -> str:
    """A fresh name part per save attempt, so a retried step never overwrites a crashed one."""
    return secrets.token_hex(6)


def pack_name(step: int, rank: int, token: str) -> str:
    return f"{step_dir(step)}/r{rank:05d}.{token}.pack"


def is_pack(name: str) -> bool:
    """Whether a file name in a step directory is a rank's pack file (pack_name's last part)."""
    return _PACK.fullmatch(name) is not None


def spare_file(token: str) -> str:
    """A spare pack file's name inside SPARES_DIR."""
    return f"{token}.pack"


def written_in_step(name: str) -> bool:
    """Whether a name in a step directory is one this library gives a file there (a pack, the manifest, COMMIT, a pin, or
    one of those under its temporary name): a collector deletes no other (a user's note left in a step directory)."""
    return _IN_STEP.fullmatch(name) is not None


def is_spare(name: str) -> bool:
    """Whether a name in the spares directory is one this library gives a spare pack file."""
    return _SPARE.fullmatch(name) is not None


def manifest_name(step: int, token: str) -> str:
    return f"{step_dir(step)}/manifest.{token}.json"


def commit_name(step: int) -> str:
    return f"{step_dir(step)}/{COMMIT_NAME}"


def check_relpath(path: object, *, what: str = "path") -> str:
    """Validate a path read from a manifest: relative, plain segments, never escaping the root."""
    if not isinstance(path, str) or not path or len(path) > 1024:
        raise ManifestError(f"{what} {path!r} is not a non-empty string of at most 1024 chars")
    parts = path.split("/")
    for part in parts:
        if part in ("", ".", "..") or not _SEGMENT.fullmatch(part):
            raise ManifestError(
                f"{what} {path!r} is unsafe: segments must match {_SEGMENT.pattern} "
                "(no absolute paths, '..', or empty segments)"
            )
    return path
