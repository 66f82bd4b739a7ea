"""Keys and version names from a manifest or HEAD are validated when it is parsed (issue 14,
Security): a crafted manifest -- with a valid checksum, as anyone who can write to the store can
make -- cannot make a follower read outside the store's root (a local directory's parent, another
S3 prefix), another version's objects, or a relay's neighbours. Refused with a ManifestError
before any part is fetched, even when the object outside holds exactly the bytes the manifest
declares."""
import json

import pytest
import torch

from dcr_testing import assert_state, zeros_like
from dcr_testing.relay import RelayProc, wait_until
from dcr_testing.s3 import make_s3_store
from nemo_dcr.errors import ManifestError
from nemo_dcr.stores import LocalStore, open_store
from nemo_dcr.sync.follower import Follower
from nemo_dcr.sync.publisher import Publisher
from nemo_dcr.sync.versions import HEAD_KEY, Head, Manifest, canonical_sha256, read_head


def state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(40, 8, generator=g), "b": torch.randn(9, generator=g).half()}


def two_versions(store):
    s = state()
    pub = Publisher(store, signer=None)
    pub.publish(s)
    s["w"][3] += 1
    pub.publish(s)
    return s


def edit(store, key, fn):
    """Edit a stored manifest's or HEAD's fields, with its checksum fixed; returns the new bytes'
    manifest identity (for HEAD's link to it)."""
    d = json.loads(store.get(key))
    fn(d)
    d.pop("checksum")
    d["checksum"] = canonical_sha256(d)
    store.put(key, json.dumps(d).encode())
    d.pop("checksum")
    return canonical_sha256(d)


def crafted(store, fn):
    """Apply ``fn`` to HEAD's manifest and relink HEAD to it (as an attacker would; a format-3
    HEAD carries the manifest: the crafted one then)."""
    head, _ = read_head(store)
    sha = edit(store, head.manifest, fn)
    new = json.loads(store.get(head.manifest))
    edit(store, HEAD_KEY, lambda d: d.update(manifest_sha256=sha, **({"newest": new} if "newest" in d else {})))
    return head


def version_dirs(store):
    head, _ = read_head(store)
    d1 = head.manifest.rsplit("/", 1)[0]
    d0 = [k for k in store.list("versions/000000000000/")][0].rsplit("/", 1)[0]
    return d0, d1


PART_KEYS = ["../outside.dcr", "{d1}/../../../../outside.dcr", "/etc/passwd", "{d1}/part-00000.dcr/../../x",
             "{d0}/key-00000.dcr", "{d1}/.part-00000.dcr", "{d1}/sub/part-00000.dcr", "{d1}\\..\\x",
             "{d1}/part-00000.dcr\x00", "versions/000000000001/../000000000000/x/part-00000.dcr", "HEAD",
             "{d1}/manifest.json", "", 7, None]


@pytest.mark.parametrize("bad", PART_KEYS)
def test_part_keys_outside_the_versions_directory_are_refused(tmp_path, bad):
    store = LocalStore(tmp_path / "s")
    two_versions(store)
    d0, d1 = version_dirs(store)
    bad = bad.format(d0=d0, d1=d1) if isinstance(bad, str) else bad
    head = crafted(store, lambda d: d["parts"][0].update(key=bad))
    with pytest.raises(ManifestError, match="not a valid nemo-dcr manifest"):
        Manifest.from_bytes(store.get(head.manifest), head.manifest)


@pytest.mark.parametrize("field,bad", [
    ("base_manifest", "../manifest.json"), ("base_manifest", "versions/000000000000/../../HEAD"),
    ("base_manifest", "HEAD"), ("base_manifest", "{d1}/manifest.json"), ("base_version", 1),
    ("base_version", -1), ("base_version", True), ("version", "1"), ("publish_id", "../x"),
    ("publish_id", ".hidden"), ("publish_id", "a/b"), ("signature", "x"),
])
def test_base_links_and_names_are_checked(tmp_path, field, bad):
    store = LocalStore(tmp_path / "s")
    two_versions(store)
    _, d1 = version_dirs(store)
    bad = bad.format(d1=d1) if isinstance(bad, str) else bad
    head = crafted(store, lambda d: d.update({field: bad}))
    with pytest.raises(ManifestError):
        Manifest.from_bytes(store.get(head.manifest), head.manifest)


@pytest.mark.parametrize("field,bad", [
    ("manifest", "../evil/manifest.json"), ("manifest", "versions/000000000000/x/manifest.json"),
    ("manifest", "/abs/manifest.json"), ("keyframe_manifest", "versions/000000000001/../../x/manifest.json"),
    ("keyframe_version", 2), ("version", -1), ("version", False),
])
def test_head_names_only_manifest_keys_of_its_versions(tmp_path, field, bad):
    store = LocalStore(tmp_path / "s")
    two_versions(store)
    edit(store, HEAD_KEY, lambda d: d.update({field: bad}))
    with pytest.raises(ManifestError, match="HEAD is not a valid"):
        Head.from_bytes(store.get(HEAD_KEY))


def test_an_object_outside_the_root_with_the_declared_bytes_is_never_read(tmp_path):
    """The part's exact bytes sit just outside the store's root; the crafted manifest names them
    with '..': refused at parse time, the receiver untouched."""
    store = LocalStore(tmp_path / "s")
    s = two_versions(store)
    head, _ = read_head(store)
    part = Manifest.from_bytes(store.get(head.manifest), head.manifest).parts[0]
    (tmp_path / "outside.dcr").write_bytes(store.get(part.key))
    store.delete(part.key)
    crafted(store, lambda d: d["parts"][0].update(key="../outside.dcr"))
    recv = zeros_like(s)
    f = Follower(store, recv, verifier=None)
    with pytest.raises(ManifestError, match="part key '../outside.dcr'"):
        f.sync()
    assert all(int(v.count_nonzero()) == 0 for v in recv.values())


def test_an_s3_manifest_cannot_reach_another_prefix(moto_s3, request):
    a = make_s3_store(moto_s3, request)
    b = make_s3_store(moto_s3, request)
    sb = two_versions(b)
    sa = two_versions(a)
    hb, _ = read_head(b)
    pb = Manifest.from_bytes(b.get(hb.manifest), hb.manifest).parts[0]
    # a's version-1 manifest pointed at b's part, by a path that climbs out of a's prefix
    climb = "../" + b.prefix.rsplit("/", 1)[-1] + "/" + pb.key
    crafted(a, lambda d: d["parts"][0].update(key=climb, sha256=pb.sha256, size=pb.size))
    recv = zeros_like(sa)
    with pytest.raises(ManifestError, match="is not an object of"):
        Follower(a, recv, verifier=None).sync()
    assert all(int(v.count_nonzero()) == 0 for v in recv.values())
    recv_b = zeros_like(sb)
    assert Follower(b, recv_b, verifier=None).sync().version == 1  # b itself is fine
    assert_state(recv_b, sb)


def test_a_crafted_manifest_through_a_relay(tmp_path):
    store = LocalStore(tmp_path / "s")
    s = two_versions(store)
    (tmp_path / "secret.dcr").write_bytes(b"SECRET")
    r = RelayProc(store.url)
    try:
        head = crafted(store, lambda d: d["parts"][0].update(key="../secret.dcr"))
        recv = zeros_like(s)
        with pytest.raises(ManifestError, match="part key"):  # (format 3: the crafted one in HEAD)
            Follower(open_store(r.url), recv, verifier=None).sync()
        open_store(r.url).get(head.manifest)  # the manifest object itself, through the relay
        # the relay did not cache the crafted manifest either. It decides once the download has
        # ended, which may be after it served the last byte: read its count once it decided
        # (read at once, 1 run in ~8 found 0 here)
        wait_until(lambda: open_store(r.url).stats()["bad_objects"] >= 1, "the relay refusing the crafted manifest",
                   timeout=10)
        # the relay is up, and serves the good version-0 objects
        d0 = [k for k in store.list("versions/000000000000/") if k.endswith(".dcr")][0]
        assert open_store(r.url).get(d0) == store.get(d0)
    finally:
        r.stop()
    assert b"SECRET" not in r.output().encode()
