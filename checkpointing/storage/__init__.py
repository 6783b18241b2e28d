"""Storage: one small protocol and its backends. Orchestration talks to tiers only through it.

Layer: I/O, below tier/. May import: checkpointing.errors, checkpointing.format (names on disk).
Public here: the protocol and its backends (`__all__`), for users who plug in their own tier or test against one.

The modules, bottom up: base.py (the protocol), redact.py (credentials out of messages), retry.py
(error classification, RetryPolicy and the Retrying wrapper), local.py (LocalStorage), endpoint.py
(a remote location; every request through the retry wrapper), transfers.py (part size, parallelism,
pacing), upload.py (multipart uploads and streams), remote.py (FsspecStorage, composed of those).
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from checkpointing.errors import CheckpointConfigError
from checkpointing.storage.base import Storage, StreamWriter
from checkpointing.storage.local import LocalStorage
from checkpointing.storage.remote import FsspecStorage
from checkpointing.storage.retry import RemoteStorageError, RetryPolicy

__all__ = ["Storage", "StreamWriter", "LocalStorage", "FsspecStorage", "RemoteStorageError", "RetryPolicy", "open_storage"]


def open_storage(url_or_path: str | os.PathLike, storage_options: Mapping[str, Any] | None = None, **kwargs: Any) -> Storage:
    """The tier at `url_or_path`: a plain path is a LocalStorage directory; a URL with a scheme
    (s3://, gs://, memory://, file://, ...) is an FsspecStorage. `kwargs` go to that class."""
    target = os.fspath(url_or_path)
    if "://" in target:
        return FsspecStorage(target, storage_options, **kwargs)
    if storage_options:
        raise CheckpointConfigError(
            f"storage_options were given for the local directory {target!r}: they apply only to URLs such as s3://bucket/path"
        )
    return LocalStorage(target, **kwargs)
