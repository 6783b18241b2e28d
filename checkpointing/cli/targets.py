"""What a command works on: the tier at TARGET and the step it names (layer: cli).

TARGET is a checkpoint directory or any tier URL (s3://bucket/prefix, file:///path, memory://...).
Credentials for a URL come from `--storage-option key=value` (repeatable; dotted keys nest, e.g.
client_kwargs.region_name=us-east-1) or from the environment the cloud SDK reads. They are never
printed: a URL shown in an error is redacted. Every failure here raises fmt.CommandFailed.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, Sequence

from checkpointing.cli.fmt import CommandFailed
from checkpointing.errors import CheckpointError
from checkpointing.storage import LocalStorage, Storage, open_storage
from checkpointing.storage.redact import is_secret_name, redact_url
from checkpointing.tier import catalog


def path_or_url(text: str) -> str:
    """A command's path argument: "~" is the home directory (as in a shell, which leaves a quoted one as it is); an
    empty one is refused (an unset variable: never the working directory)."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path (an unset variable?): pass a checkpoint directory or a URL")
    return text if "://" in text else os.path.expanduser(text)


def add_target(parser: argparse.ArgumentParser) -> None:
    """A command's TARGET and its --storage-option values."""
    parser.add_argument("dir", metavar="TARGET", type=path_or_url, help="checkpoint directory, or a tier URL (s3://bucket/prefix, file:///path, ...)")
    parser.add_argument("--storage-option", "-o", action="append", metavar="KEY=VALUE", default=[],
                        help="fsspec storage option for a URL (repeatable; e.g. endpoint_url=http://127.0.0.1:9000); "
                             "credentials may come from the environment instead")


def open_target(target: str, option_pairs: Sequence[str] = ()) -> Storage:
    """The tier at `target`: a directory that must exist, or a URL opened with the --storage-option values."""
    options = storage_options(option_pairs)
    if "://" not in target:
        root = Path(target)
        if not root.is_dir():
            raise CommandFailed(f"{target}: {'a file, not' if root.exists() else 'no such'} checkpoint directory")
        if options:
            raise CommandFailed("--storage-option applies to URLs (s3://bucket/prefix), not to a directory")
        return LocalStorage(root, direct=False)
    try:
        storage = open_storage(target, options or None)
        storage.list("")  # reachable, and the credentials work
    except (CheckpointError, OSError) as exc:
        text = str(exc)
        raise CommandFailed(text if text.startswith("cannot open") else f"cannot open {redact_url(target)}: {text}") from None
    return storage


def storage_options(pairs: Sequence[str]) -> dict[str, Any]:
    """['a=1', 'client_kwargs.region_name=x'] -> {'a': 1, 'client_kwargs': {'region_name': 'x'}}."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise CommandFailed(f"--storage-option {key or pair!r}: expected KEY=VALUE")
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise CommandFailed(f"--storage-option {key}: {part} is both a value and a group")
        node[leaf] = raw if is_secret_name(leaf) else _value(raw)  # a credential is the text typed, digits or not
    return out


def _value(raw: str) -> Any:
    """true/false/null, and integers and floats written as Python writes them ("8", "2.5"), as such; anything else
    (a key, a URL, "0123", "1e5") stays the string typed."""
    if raw in ("true", "false", "null"):
        return {"true": True, "false": False, "null": None}[raw]
    for kind in (int, float):
        try:
            value = kind(raw)
        except ValueError:
            continue
        return value if str(value) == raw else raw
    return raw


def committed_step(storage: Storage, step: int | None) -> int:
    """`step` when it is committed on `storage`; with None, the newest committed step."""
    committed = catalog.list_steps(storage).committed
    if step is None:
        if not committed:
            raise CommandFailed(f"{storage.url}: no committed step")
        return committed[-1]
    if step not in committed:
        raise CommandFailed(f"step {step} is not committed in {storage.url} (committed: {committed})")
    return step
