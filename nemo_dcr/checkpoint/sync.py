"""The store commands of the CLI on safetensors checkpoints: publish, pull, log, verify."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from nemo_dcr.checkpoint.safetensors_io import (
    ST_DTYPES,
    ST_NAMES,
    Checkpoint,
    CheckpointError,
    check_layout,
    has_layout,
    layout_for,
    owned_files,
    write_checkpoint,
)
from nemo_dcr.codec.names import DEFAULT_LEVEL
from nemo_dcr.errors import DcrError, VersionNotFound
from nemo_dcr.state.statedigest import state_contrib
from nemo_dcr.sync.versions import Found, locate, read_head, walk

if TYPE_CHECKING:
    from nemo_dcr.stores.base import Store
    from nemo_dcr.sync.follower import SyncResult


def _open(store: Store | str, *, create: bool = True) -> Store:
    """The store a URL names. Reads pass ``create=False``: a mistyped local path is an error,
    not a new empty store."""
    from nemo_dcr.stores import open_store
    if not isinstance(store, str):
        return store
    local = "://" not in store or store.startswith("file://")
    return open_store(store, create=create) if local else open_store(store)


def open_for_reading(store):
    """The store a URL names, for reading (a mistyped local path is an error)."""
    return _open(store, create=False)


def load_checkpoint(path: str) -> tuple[dict, dict]:
    ck = Checkpoint(path)
    return {k: ck[k] for k in ck}, ck.layout()


def publish_checkpoint(store: Store | str, path: str, *, keyframe_every: int = 0, keyframe: bool = False,
                       retain=None,
                       encoding: str = "auto", level: int = DEFAULT_LEVEL, signer="env", trusted_keys=(),
                       new_model: bool = False, progress: bool | None = None, format_version: int | None = None,
                       object_checksum: str | None = None):
    """Publish the checkpoint at ``path`` as the store's next version. A checkpoint of which less
    than half of the tensors (the larger set's: same names, dtypes, shapes) are the store's last
    version's is another model, not the next version of this one: refused unless ``new_model`` (then it is a
    keyframe; receivers rebuild from it). ``progress``: a bar while it encodes (None: when stderr
    is a terminal). ``format_version`` and ``object_checksum``: the ``Publisher``'s (None: its
    defaults), checked before the checkpoint is read."""
    from nemo_dcr.sync.publisher import Publisher, format_choice
    fmt = format_choice(format_version, object_checksum)
    tensors, layout = load_checkpoint(path)
    st = _open(store)
    if not new_model:
        _refuse_unrelated(st, path, tensors)
    pub = Publisher(st, keyframe_every=keyframe_every, retain=retain, encoding=encoding, level=level,
                    signer=signer, trusted_keys=trusted_keys, progress=progress, **fmt)
    return pub.publish(tensors, keyframe=keyframe or new_model, meta={"layout": layout})


def _refuse_unrelated(store, path: str, tensors: dict) -> None:
    """Refuse a checkpoint unrelated to the store's last version (see ``publish_checkpoint``),
    known from that version's recorded file layout alone (nothing is downloaded; a version
    without a layout, or a store whose HEAD cannot be read, is left to the publisher)."""
    import math

    from nemo_dcr.sync.versions import head_manifest
    try:
        head, _ = read_head(store)
        if head is None:
            return
        m = head_manifest(store, head)
        layout = (m.meta or {}).get("layout")
        if layout is None:
            return
        files = check_layout(layout, None, f"version {m.version}'s file layout")["files"]
    except DcrError:
        return
    chain = {t: (i["dtype"], tuple(i["shape"])) for f in files for t, i in f["parsed"].items() if t != "__metadata__"}
    new = {n: (ST_NAMES[t.dtype], tuple(t.shape)) for n, t in tensors.items()}
    same = sum(1 for n, v in new.items() if chain.get(n) == v)
    # by tensors, not elements: a schema change (one tensor added, renamed, reshaped, re-typed)
    # keeps most tensors even where the one it changes holds most of the elements
    if 2 * same < max(len(chain), len(new)):
        kept = sum(math.prod(s) for n, (d, s) in new.items() if chain.get(n) == (d, s))
        total = max(sum(math.prod(s) for _, s in chain.values()), sum(math.prod(s) for _, s in new.values()), 1)
        raise DcrError(f"{path} is not a next version of the model in the store: {same} of its {len(new)} "
                       f"tensor(s) ({100 * kept / total:.0f} % of the elements) match version {m.version}'s "
                       f"{len(chain)} in name, dtype and shape; publish it with --new-model to replace the model "
                       "(a keyframe: receivers rebuild from it), or into another store")


def history(store: Store | str, limit: int | None = None) -> list:
    """Committed manifests, newest first, as far back as the store still has them (verified when
    ``store`` is a VerifiedStore, or trusted keys are in the environment)."""
    from nemo_dcr.sync.signing import verifying
    store = verifying(_open(store, create=False))
    head, _ = read_head(store)
    out: list = []
    for m in walk(store, head) if head is not None else ():
        if limit is not None and len(out) >= limit:
            break
        out.append(m)
    return out


def find_version(store: Store | str, tensors: dict) -> int | None:
    """The newest committed version whose digest ``tensors`` have, if the store can still say
    (:func:`~nemo_dcr.sync.versions.locate`: read from HEAD down, up to a manifest that cannot
    be read)."""
    from nemo_dcr.sync.signing import verifying
    m = locate(verifying(_open(store, create=False)), _Digests(tensors)).manifest
    return None if m is None else m.version


class _Digests:
    """The state digest's text of ``tensors`` under a definition (``Manifest.definition``), each
    summed once, when a walk down the chain first meets a manifest of it (``locate``).
    ``first``: the definition asked for first (HEAD's manifest's)."""

    def __init__(self, tensors):
        self.tensors, self.texts = tensors, {}
        self.first: int | None = None

    def __call__(self, definition: int) -> str:
        if definition not in self.texts:
            self.texts[definition] = state_contrib(self.tensors, definition=definition).hex()
            self.first = definition if self.first is None else self.first
        return self.texts[definition]


@dataclass
class PullResult:
    sync: SyncResult
    rewritten: bool = False  # the tensors were at the version but the files' bytes were not


def pull_checkpoint(store: Store | str, out: str, version: int | None = None,
                    progress: bool | None = None) -> PullResult:
    """Bring the checkpoint at ``out`` (created if missing) to ``version`` (default newest).

    Promise: afterwards the checkpoint's files at ``out`` are byte for byte the files of that
    version as published (names, headers with their metadata, data order, index), or, for a
    version published without a file layout, the canonical single file of its tensors. A
    checkpoint already holding the version's tensors is checked against that too and rewritten
    when its files differ. Other files in a directory ``out`` are left alone. ``progress``: a bar
    while it downloads (None: when stderr is a terminal)."""
    from nemo_dcr.sync.follower import Follower
    from nemo_dcr.sync.signing import verifying
    store = verifying(_open(store, create=False))  # locate reads manifests too: verify them
    head, _ = read_head(store)
    if head is None:
        raise VersionNotFound("the store has no committed version yet")
    tensors: dict = {}
    current = None
    if os.path.isdir(out) and not owned_files(out) or not os.path.exists(out):
        ckpt = None  # nothing yet (a model directory may hold config files only)
    else:
        try:
            ckpt = Checkpoint(out)
            tensors = {k: ckpt[k] for k in ckpt}
        except CheckpointError as e:
            raise DcrError(f"{out} exists but is not a checkpoint this command can update: {e}") from None
        # the version held, if a pull can use it: found above any manifest that cannot be read,
        # and, for a pull to HEAD, within the deltas that cost less than the newest keyframe (a
        # pull to another version is planned from the version held, wherever it is: going back)
        current = locate(store, _Digests(tensors), head, worth_fetching=version is None).manifest
        if current is None:
            tensors = {}  # not a version the store knows: rebuild from the newest keyframe
    if current is None:
        tensors = _whole_tensors_for_shards(store, head)
    f = Follower(store, tensors, manifest=current, verify_initial=False, progress=progress)
    if current is not None and f.manifest is not None:
        _empty_tensors_of(tensors, f.manifest)
    res = f.sync(version, head=head)
    m = f.manifest  # the very manifest whose state was verified
    if m is None:  # sync returned, so the follower holds a verified version
        raise DcrError(f"{out}: the sync ended without a version")
    layout = (m.meta or {}).get("layout") or layout_for(tensors)
    where = f"version {res.version}'s file layout"
    held = {t for f in check_layout(layout, None, where)["files"] for t in f["parsed"] if t != "__metadata__"}
    for n in [n for n, t in tensors.items() if n not in held and t.numel() == 0]:
        del tensors[n]  # adds nothing to the state digest: the version's files decide whether it is there
    layout = check_layout(layout, tensors, where)
    if not res.updated and current is not None and ckpt is not None and has_layout(ckpt, layout):
        return PullResult(res)
    write_checkpoint(out, layout, lambda name: tensors[name])
    return PullResult(res, rewritten=not res.updated)


def _empty_tensors_of(tensors: dict, m) -> None:
    """Give ``tensors`` exactly the tensors without elements that version ``m``'s file layout
    holds. They add nothing to the state digest, so a checkpoint recognised as ``m`` by its
    digest may be a neighbour that lacks (or has) one: the deltas after ``m`` take them as
    ``m`` has them. A version published without a layout (the Python API) says nothing here."""
    layout = (m.meta or {}).get("layout")
    if layout is None:
        return
    files = check_layout(layout, None, f"version {m.version}'s file layout")["files"]
    empty = {t: info for f in files for t, info in f["parsed"].items()
             if t != "__metadata__" and 0 in info["shape"]}
    for n in [n for n, t in tensors.items() if t.numel() == 0 and n not in empty]:
        del tensors[n]
    import torch
    for n, info in empty.items():
        t = tensors.get(n)
        if t is None or (t.numel() == 0 and (ST_NAMES.get(t.dtype) != info["dtype"] or list(t.shape) != info["shape"])):
            tensors[n] = torch.empty(info["shape"], dtype=ST_DTYPES[info["dtype"]])


def _whole_tensors_for_shards(store, head) -> dict:
    """A checkpoint pulled from nothing starts from the newest keyframe. Where that keyframe's
    parts carry a tensor as shards (a trainer group published it, one part per rank), the
    receiver needs the whole tensor to write each shard into: zeros of its global shape and dtype,
    every element then overwritten by some part (the version's digest checks that none was
    missed). Whole tensors in a part are created by the apply itself. Costs a second read of the
    keyframe's parts, on a bootstrap only."""
    import torch

    from nemo_dcr.codec.format import DeltaReader
    from nemo_dcr.sync.versions import read_manifest
    if head.keyframe_manifest is None:
        return {}
    out = {}
    for p in read_manifest(store, head.keyframe_manifest, head.keyframe_sha256).keyframe_parts:
        for e in DeltaReader.open(store.get(p.key)).header.tensors:
            if e.region is not None and not e.region.is_full and e.name not in out:
                out[e.name] = torch.zeros(e.region.global_shape, dtype=e.torch_dtype)
    return out


def locate_checkpoint(store: Store | str, path: str) -> tuple[Found, str]:
    """-> (what :func:`~nemo_dcr.sync.versions.locate` found for the checkpoint at ``path``, the
    checkpoint's state digest: under the definition of the manifest found, else of HEAD's). The
    whole chain is searched, down to a manifest that cannot be read (``Found.ended`` says which)."""
    from nemo_dcr.sync.signing import verifying
    tensors, _ = load_checkpoint(path)
    digests = _Digests(tensors)
    found = locate(verifying(_open(store, create=False)), digests)
    definition = found.manifest.definition if found.manifest is not None else digests.first
    return found, digests(definition or 1)


def verify_checkpoint(store: Store | str, path: str) -> tuple[int | None, str]:
    """-> (the newest version the checkpoint at ``path`` is, or None; its state digest)."""
    found, d = locate_checkpoint(store, path)
    return (found.manifest.version if found.manifest is not None else None), d


__all__ = ["publish_checkpoint", "pull_checkpoint", "history", "verify_checkpoint", "locate_checkpoint",
           "find_version", "open_for_reading"]
del torch
