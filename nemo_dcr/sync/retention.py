"""Retention: delete what no receiver can still need.

Kept: the newest keyframe and every version after it, the newest ``keep`` versions, and
anything at a version newer than HEAD (a publish may be in flight there). Removed: older
versions, and at versions up to HEAD, objects of publishes that never committed (orphans of a
lost race or of a rank that died mid-upload); below the cutoff also the unfinished writes of
writers killed mid-object (``Store.drop_unfinished``: hidden temporaries, incomplete multipart
uploads), which no listing shows.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from nemo_dcr.errors import ManifestError, VersionNotFound
from nemo_dcr.sync.versions import Head, key_version, walk

if TYPE_CHECKING:
    from nemo_dcr.stores.base import Store

log = logging.getLogger("nemo_dcr.sync")


def prune(store: Store, head: Head, keep: int = 0) -> list:
    """Returns the deleted keys."""
    cutoff = min(head.keyframe_version, head.version - max(keep, 0))
    committed = {}  # committed publish id of every version still reachable from HEAD
    try:
        for m in walk(store, head, missing_ok=False):
            committed[m.version] = m.publish_id
            if m.version <= cutoff:
                break
    except (VersionNotFound, ManifestError) as e:
        # a gap or a damaged manifest above the cutoff: delete nothing (what is kept cannot be
        # told from what is not); the version is committed all the same, and retention resumes
        # once a keyframe newer than the break moves the cutoff past it
        log.warning("nemo-dcr: retention after version %d skipped: %s", head.version, e)
        return []
    deleted = []
    for key in store.list("versions/"):
        v, pid = key_version(key)
        if v is None or v > head.version:
            continue
        if v < cutoff or committed.get(v) != pid:
            store.delete(key)
            deleted.append(key)
    # what writers killed mid-object left (invisible to list): below the cutoff no publish can
    # still commit, so nobody is still writing there
    drop = getattr(type(store), "drop_unfinished", None)
    if drop is not None:
        def below(key: str) -> bool:
            v = key_version(key)[0]
            return v is not None and v < cutoff

        n = drop(store, "versions/", below)
        if n:
            log.info("nemo-dcr: retention dropped %d unfinished object write(s) below version %d", n, cutoff)
    return deleted
