"""The store commands of the CLI on safetensors checkpoints: publish, pull, log, verify."""
from __future__ import annotations

import os

import torch

from nemo_dcr.errors import DcrError
from nemo_dcr.checkpoint.safetensors_io import Checkpoint, CheckpointError, atomic_output, layout_for, write_file
from nemo_dcr.state.statedigest import state_contrib
from nemo_dcr.sync.versions import read_head, walk


def _open(store):
    from nemo_dcr.stores import open_store
    return open_store(store) if isinstance(store, str) else store


def load_checkpoint(path: str) -> tuple[dict, dict]:
    ck = Checkpoint(path)
    return {k: ck[k] for k in ck}, ck.layout()


def publish_checkpoint(store, path: str, *, keyframe_every: int = 0, keyframe: bool = False, retain=None,
                       encoding: str = "auto", level: int = 3):
    from nemo_dcr.sync.publisher import Publisher
    tensors, layout = load_checkpoint(path)
    pub = Publisher(_open(store), keyframe_every=keyframe_every, retain=retain, encoding=encoding, level=level)
    return pub.publish(tensors, keyframe=keyframe, meta={"layout": layout})


def history(store, limit: int | None = None) -> list:
    """Committed manifests, newest first, as far back as the store still has them."""
    store = _open(store)
    head, _ = read_head(store)
    out = []
    for m in walk(store, head) if head is not None else ():
        if limit is not None and len(out) >= limit:
            break
        out.append(m)
    return out


def find_version(store, tensors: dict) -> int | None:
    """The committed version whose digest ``tensors`` have, if any is still in the store."""
    d = state_contrib(tensors).hex()
    for m in history(store):
        if m.target_digest == d:
            return m.version
    return None


def pull_checkpoint(store, out: str, version: int | None = None):
    """Bring the checkpoint at ``out`` (created if missing) to ``version`` (default newest)."""
    from nemo_dcr.sync.follower import Follower
    store = _open(store)
    tensors, current = {}, None
    if os.path.exists(out):
        try:
            tensors, _ = load_checkpoint(out)
        except CheckpointError as e:
            raise DcrError(f"{out} exists but is not a checkpoint this command can update: {e}") from None
        current = find_version(store, tensors)
        if current is None:
            tensors = {}  # not a version the store knows: rebuild from the newest keyframe
    f = Follower(store, tensors, version=current, verify_initial=False)
    res = f.sync(version)
    if not res.updated and current is not None:
        return res
    m = f.manifest  # the very manifest whose state was verified
    layout = (m.meta or {}).get("layout") or layout_for(tensors)
    if set(_layout_names(layout)) != set(tensors):
        layout = layout_for(tensors)
    is_dir = layout["kind"] == "dir"
    with atomic_output(out, is_dir=is_dir) as tmp:
        for f_ in layout["files"]:
            path = os.path.join(tmp, f_["name"]) if is_dir else tmp
            write_file(path, f_["header"], lambda name: tensors[name])
        if is_dir and layout.get("index") is not None:
            with open(os.path.join(tmp, "model.safetensors.index.json"), "wb") as fi:
                fi.write(layout["index"].encode())
    return res


def _layout_names(layout):
    import json
    for f in layout["files"]:
        for k in json.loads(f["header"]):
            if k != "__metadata__":
                yield k


def verify_checkpoint(store, path: str):
    tensors, _ = load_checkpoint(path)
    return find_version(_open(store), tensors), state_contrib(tensors).hex()


__all__ = ["publish_checkpoint", "pull_checkpoint", "history", "verify_checkpoint", "find_version"]
del torch
