"""The sizes of many objects at once (layer: storage, I/O): what a commit checks before COMMIT.

A size is one HEAD (a round trip) per object, and rank 0's remote commit checks every rank's file
of the step: 1,024 sequential round trips per upload at 1,024 ranks. An object store lists up to
1,000 objects with their sizes per request, so the objects are grouped by directory and each
directory holding several of them is listed once. An object the listing does not show is asked for
by itself, so a store whose listings lag behind its writes still answers exactly.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from checkpointing.storage.endpoint import Endpoint

LIST_FROM = 4  # objects wanted in one directory from which one listing beats a HEAD each


def one_by_one(storage: Any, paths: list[str]) -> dict[str, int | None]:
    """Storage.sizes where sizes are cheap (a local stat): `size` per path, None if missing."""
    out: dict[str, int | None] = {}
    for path in paths:
        try:
            out[path] = storage.size(path)
        except FileNotFoundError:
            out[path] = None
    return out


def listed_or_one_by_one(storage: Any, paths: list[str], listed: Callable[[str], dict[str, int]]) -> dict[str, int | None]:
    """Storage.sizes for object stores: `listed(directory)` (name -> size of the objects in it) for
    each directory with LIST_FROM or more of `paths`, `size` for the rest and for any path the
    listing did not show."""
    by_dir: dict[str, list[str]] = collections.defaultdict(list)
    for path in paths:
        by_dir[path.rpartition("/")[0]].append(path)
    out: dict[str, int | None] = {}
    for directory, wanted in by_dir.items():
        shown = listed(directory) if len(wanted) >= LIST_FROM else {}
        found = {p: shown[p.rpartition("/")[2]] for p in wanted if p.rpartition("/")[2] in shown}
        out.update(found)
        out.update(one_by_one(storage, [p for p in wanted if p not in found]))
    return out


def listed(endpoint: Endpoint, directory: str) -> dict[str, int]:
    """Name -> size of the objects directly in `directory` (s3: ListObjectsV2, 1,000 per request;
    elsewhere fsspec's ls with details). A missing directory lists nothing."""
    if endpoint.is_s3:
        return {o["Key"][len(under) :]: int(o["Size"]) for under, page in endpoint.s3_listing(directory, delimiter=True)
                for o in page.get("Contents", [])}
    return {e["name"].rstrip("/").rpartition("/")[2]: int(e["size"]) for e in endpoint.ls(directory) if e.get("type") == "file"}
