"""Manifests and HEAD carry a checksum (issue 13 item 7): one edited byte in a stored manifest
or in HEAD gives a clear error, never a different file with exit status 0; a manifest named by
HEAD or by the next version's base link must be the very one recorded. Stores written before
checksums (format 1) stay readable. Manifests' derived properties (issue 9) live here too."""
import json

import pytest
import torch
from safetensors.torch import save_file

from dcr_testing import assert_state, zeros_like
from nemo_dcr.checkpoint.sync import publish_checkpoint, pull_checkpoint
from nemo_dcr.errors import DcrError, ManifestError
from nemo_dcr.stores import LocalStore
from nemo_dcr.sync.follower import Follower
from nemo_dcr.sync.publisher import Publisher
from nemo_dcr.sync.versions import HEAD_KEY, Manifest, canonical_sha256, read_head, read_manifest, walk


def state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(32, 16, generator=g).bfloat16(), "b": torch.randn(16, generator=g)}


@pytest.fixture
def published(tmp_path):
    """A checkpoint file with free-form metadata, published as version 0 of a local store."""
    src = tmp_path / "model.safetensors"
    save_file(state(), str(src), metadata={"format": "pt", "note": "hello world"})
    store = LocalStore(str(tmp_path / "store"))
    publish_checkpoint(store, str(src))
    return store, src


def flips(data: bytes, every: int = 1):
    """One edited byte (the lowest bit flipped: a digit becomes another digit, a letter another
    letter) at every ``every``-th position."""
    for pos in range(0, len(data), every):
        yield pos, data[:pos] + bytes([data[pos] ^ 0x01]) + data[pos + 1:]


def pull_or_error(store, out):
    """-> None when the pull raised a DcrError, else the bytes written."""
    try:
        pull_checkpoint(store, str(out))
    except DcrError:
        return None
    return out.read_bytes()


def test_one_edited_byte_in_the_manifest_never_gives_a_different_file(published, tmp_path):
    store, src = published
    key = read_head(store)[0].manifest
    good = store.get(key)
    want = src.read_bytes()
    n = 0
    for pos, bad in flips(good, every=3):
        store.put(key, bad)
        out = tmp_path / f"out-{n}.safetensors"
        n += 1
        got = pull_or_error(store, out)
        assert got is None or got == want, f"byte {pos} of the manifest edited: a different file, no error"
    store.put(key, good)
    assert pull_or_error(store, tmp_path / "again.safetensors") == want


def test_an_edited_metadata_byte_is_a_manifest_error(published, tmp_path):
    store, src = published
    key = read_head(store)[0].manifest
    good = store.get(key)
    pos = good.index(b"hello world")
    store.put(key, good[:pos] + b"j" + good[pos + 1:])
    with pytest.raises(ManifestError, match="checksum"):
        pull_checkpoint(store, str(tmp_path / "out.safetensors"))
    assert not (tmp_path / "out.safetensors").exists()


def test_one_edited_byte_in_head_is_caught(published, tmp_path):
    store, src = published
    good = store.get(HEAD_KEY)
    for _pos, bad in flips(good, every=2):
        store.put(HEAD_KEY, bad)
        with pytest.raises(ManifestError):
            read_head(store)
    store.put(HEAD_KEY, good)
    assert read_head(store)[0].version == 0


@pytest.mark.parametrize("fv", [2, 3])
def test_head_and_base_links_name_the_very_manifest(tmp_path, fv):
    store = LocalStore(str(tmp_path / "s"))
    s = state(1)
    pub = Publisher(store, format_version=fv)
    pub.publish(s)
    s["b"][0] += 1
    pub.publish(s)
    head = read_head(store)[0]
    m1 = Manifest.from_bytes(store.get(head.manifest), head.manifest)
    assert head.manifest_sha256 == m1.sha256 and m1.base_sha256 is not None
    # a valid manifest that is not the one recorded (re-sealed after an edit): refused by HEAD
    forged = Manifest(**{**m1.__dict__, "step": 99})
    store.put(head.manifest, forged.to_bytes())
    with pytest.raises(ManifestError, match="not the manifest its referrer recorded"):
        read_manifest(store, head.manifest, head.manifest_sha256)
    if fv == 2:
        with pytest.raises(ManifestError, match="not the manifest its referrer recorded"):
            Follower(store, zeros_like(s)).sync()
    else:  # HEAD carries the manifest: the forged copy in the store is not read ...
        assert head.newest_manifest == m1 and Follower(store, zeros_like(s)).sync().version == 1
        d = json.loads(store.get(HEAD_KEY))  # ... and the forged one carried in a re-sealed HEAD is refused
        d["newest"] = forged.stored()
        d.pop("checksum")
        d["checksum"] = canonical_sha256(d)
        store.put(HEAD_KEY, json.dumps(d).encode())
        with pytest.raises(ManifestError, match="not the manifest its referrer recorded"):
            Follower(store, zeros_like(s)).sync()
        store.put(HEAD_KEY, head.to_bytes())
    store.put(head.manifest, m1.to_bytes())
    base = Manifest.from_bytes(store.get(m1.base_manifest), m1.base_manifest)
    store.put(base.key, Manifest(**{**base.__dict__, "step": 5}).to_bytes())
    with pytest.raises(ManifestError, match="not the manifest its referrer recorded"):
        list(walk(store, head))


def test_format_1_stores_stay_readable_and_are_upgraded_by_the_next_publish(tmp_path):
    """Stores written before checksums: manifests with format 1 and no checksum, a HEAD without
    digests. Read unverified; the next commit writes format 5 (the default) and seals HEAD."""
    store = LocalStore(str(tmp_path / "s"))
    s = state(2)
    pub = Publisher(store, object_checksum="sha256")  # format-1 parts named their sha256
    pub.publish(s)
    s["w"][0, 0] += 1
    pub.publish(s)
    for key in store.list("versions/"):
        if key.endswith("manifest.json"):
            d = json.loads(store.get(key))
            d.pop("checksum"), d.pop("base_sha256")
            d["format"] = 1
            store.put(key, json.dumps(d, sort_keys=True, indent=1).encode())
    h = json.loads(store.get(HEAD_KEY))
    for k in ("checksum", "manifest_sha256", "keyframe_sha256", "format", "newest"):
        h.pop(k)
    store.put(HEAD_KEY, json.dumps(h, sort_keys=True).encode())
    assert read_head(store)[0].format == 1
    recv = zeros_like(s)
    f = Follower(store, recv)
    assert f.sync().steps == [("keyframe", 0), ("delta", 1)]
    assert_state(recv, s)
    s["b"][3] -= 2
    Publisher(store).publish(s)  # a restarted trainer on the old store
    head = read_head(store)[0]
    assert head.format == 5 and head.manifest_sha256 and head.keyframe_sha256 and head.newest_manifest is not None
    assert f.sync().steps == [("delta", 2)]
    assert_state(recv, s)


def test_manifest_derived_properties():
    from nemo_dcr.sync.versions import Part
    kf = [Part(0, "k0", 10, "x", 0, 6, 12), Part(1, "k1", 10, "y", 0, 4, 8)]
    delta = [Part(0, "p0", 3, "z", 2, 6, 12), Part(1, "p1", 3, "w", 1, 4, 8)]
    m = Manifest(0, "id", "d" * 32, keyframe_parts=kf)
    assert (m.kind, m.elements, m.dense_bytes, m.changed, m.change_rate) == ("keyframe", 10, 20, 0, None)
    m = Manifest(1, "id", "d" * 32, 0, "k", "e" * 32, parts=delta)
    assert (m.kind, m.elements, m.dense_bytes, m.changed, m.change_rate) == ("delta", 10, 20, 3, 0.3)
    m = Manifest(2, "id", "d" * 32, 1, "k", "e" * 32, parts=delta, keyframe_parts=kf)
    assert m.kind == "delta+keyframe" and m.is_keyframe
