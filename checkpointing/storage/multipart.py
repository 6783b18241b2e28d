"""Unfinished multipart uploads of an S3 tier (layer: storage, I/O): what `checkpointing gc` finds and aborts.

A process whose abort failed (the network went) or that was killed mid-upload leaves a multipart upload
that the listing of objects does not show, and its parts are stored until it is aborted (or a bucket's
lifecycle rule aborts it).
"""

from __future__ import annotations

import time

from checkpointing.storage.remote import FsspecStorage


def stale_uploads(storage: FsspecStorage, older_than_s: float) -> list[tuple[str, str, float]]:
    """S3: the multipart uploads below the storage's prefix started more than `older_than_s` seconds ago and neither
    completed nor aborted: (path, upload id, age in seconds). Elsewhere: none."""
    if not storage.is_s3:
        return []
    ep, out = storage.endpoint, []
    prefix = f"{ep.prefix}/" if ep.prefix else ""
    markers: dict[str, str] = {}
    while True:
        page = ep.s3("list multipart uploads", "", "list_multipart_uploads", Prefix=prefix, **markers)
        now = time.time()
        for up in page.get("Uploads", []):
            age = now - up["Initiated"].timestamp()
            if age >= older_than_s:
                out.append((up["Key"][len(prefix):], up["UploadId"], age))
        if not page.get("IsTruncated"):
            return out
        markers = {"KeyMarker": page.get("NextKeyMarker", ""), "UploadIdMarker": page.get("NextUploadIdMarker", "")}


def abort_upload(storage: FsspecStorage, path: str, upload_id: str) -> None:
    """S3: abort the multipart upload `upload_id` of `path` (its parts are freed)."""
    try:
        storage.endpoint.s3("abort upload", path, "abort_multipart_upload", Key=storage.endpoint.key(path), UploadId=upload_id)
    except FileNotFoundError:  # completed or aborted meanwhile
        pass
