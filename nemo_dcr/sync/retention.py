"""Retention: delete what no receiver can still need.

Kept: the newest keyframe and every version after it, the newest ``keep`` versions, and
anything at a version newer than HEAD (a publish may be in flight there). Removed: older
versions, and at versions up to HEAD, objects of publishes that never committed (orphans of a
lost race or of a rank that died mid-upload).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from nemo_dcr.sync.versions import Head, walk

if TYPE_CHECKING:
    from nemo_dcr.stores.base import Store


def _version_of(key: str):
    parts = key.split("/")
    if len(parts) >= 3 and parts[0] == "versions" and parts[1].isdigit():
        return int(parts[1]), parts[2]
    return None, None


def prune(store: Store, head: Head, keep: int = 0) -> list:
    """Returns the deleted keys."""
    cutoff = min(head.keyframe_version, head.version - max(keep, 0))
    committed = {}  # committed publish id of every version still reachable from HEAD
    for m in walk(store, head, missing_ok=False):  # a gap above the cutoff: delete nothing
        committed[m.version] = m.publish_id
        if m.version <= cutoff:
            break
    deleted = []
    for key in store.list("versions/"):
        v, pid = _version_of(key)
        if v is None or v > head.version:
            continue
        if v < cutoff or committed.get(v) != pid:
            store.delete(key)
            deleted.append(key)
    return deleted
