"""Objects written as a stream (stores/writer.py): the publisher encodes into them.

Against the real backends: a LocalStore directory and S3Store on the moto server over HTTP.
What must hold: nothing is visible under the key until ``commit``, then exactly the bytes
written (size and checksum as the writer counted them); ``abort`` or a failure leaves no object,
no temporary file and no open multipart upload; S3 parts go up while the writer is still being
written; a store whose ``put`` is wrapped keeps ``put`` as its one write path.
"""
from __future__ import annotations

import hashlib
import os
import subprocess

import blake3
import pytest
import torch

from dcr_testing.s3 import make_s3_store
from nemo_dcr import diff, inspect
from nemo_dcr.delta.stats import totals
from nemo_dcr.errors import PublishError
from nemo_dcr.stores import HttpStore, LocalStore, StoreError
from nemo_dcr.stores.writer import BufferedWriter, open_writer
from nemo_dcr.sync.follower import Follower
from nemo_dcr.sync.publisher import Publisher
from nemo_dcr.sync.versions import read_head

MiB = 1 << 20


def _pieces(seed: int, sizes) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).numpy().tobytes() for n in sizes]


def _visible(store, key) -> bool:
    return store.exists(key) or key in store.list("")


def _leftovers(root) -> list:
    """Hidden temporaries anywhere under a local store's root (its lock files aside)."""
    return [os.path.join(d, f) for d, dirs, files in os.walk(root) for f in files
            if ".tmp-" in f and ".locks" not in d]


def _uploads(store) -> list:
    r = store.client.list_multipart_uploads(Bucket=store.bucket, Prefix=store.prefix)
    return r.get("Uploads", [])


def test_bytes_appear_whole_at_commit_only(store):
    data = _pieces(0, [0, 1, 4095, 70_000, 3])
    w = store.open_writer("v/obj.dcr")
    for i, p in enumerate(data):  # bytes, bytearray and a memoryview of a wider typed buffer
        w.write(p if i % 3 == 0 else bytearray(p) if i % 3 == 1 else memoryview(p))
        assert not _visible(store, "v/obj.dcr")
    w.write(memoryview(torch.arange(5, dtype=torch.int32).numpy()))
    want = b"".join(data) + torch.arange(5, dtype=torch.int32).numpy().tobytes()
    assert w.size == len(want) and w.checksum == hashlib.sha256(want).hexdigest()
    w.commit()
    assert store.get("v/obj.dcr") == want
    with pytest.raises(StoreError, match="already committed"):
        w.write(b"x")
    with pytest.raises(StoreError, match="already committed"):
        w.commit()


def test_abort_leaves_nothing(store, tmp_path):
    store.put("v/obj.dcr", b"old")
    w = store.open_writer("v/obj.dcr")
    w.write(b"new bytes" * 1000)
    w.abort()
    w.abort()  # twice: quiet
    assert store.get("v/obj.dcr") == b"old"
    with pytest.raises(StoreError, match="already aborted"):
        w.write(b"x")
    if isinstance(store, LocalStore):
        assert _leftovers(store.root) == []
    with pytest.raises(RuntimeError), store.open_writer("v/other.dcr") as w2:  # an error in the block aborts
        w2.write(b"partial")
        raise RuntimeError("encode failed")
    assert not _visible(store, "v/other.dcr")


def test_s3_parts_upload_while_the_object_is_written(moto_s3, request):
    store = make_s3_store(moto_s3, request, multipart_threshold=5 * MiB)  # 5 MiB parts, S3's least
    data = _pieces(1, [3 * MiB] * 5)  # 15 MiB: parts 1-2 go up during the writes, 3 at commit
    w = store.open_writer("v/big.dcr")
    for p in data[:4]:
        w.write(p)
    w.flush()  # the parts handed over so far have landed
    ups = [u for u in _uploads(store) if u["Key"].endswith("v/big.dcr")]
    assert len(ups) == 1, "no multipart upload open while the object is being written"
    parts = store.client.list_parts(Bucket=store.bucket, Key=ups[0]["Key"], UploadId=ups[0]["UploadId"])["Parts"]
    assert [p["PartNumber"] for p in parts] == [1, 2]
    assert not _visible(store, "v/big.dcr")
    w.write(data[4])
    w.commit()
    assert store.get("v/big.dcr") == b"".join(data)
    assert w.checksum == hashlib.sha256(b"".join(data)).hexdigest()
    assert [u for u in _uploads(store) if u["Key"].endswith("v/big.dcr")] == []


def test_s3_a_lost_upload_fails_the_commit_and_leaves_no_object(moto_s3, request):
    store = make_s3_store(moto_s3, request, multipart_threshold=5 * MiB)
    w = store.open_writer("v/lost.dcr")
    w.write(_pieces(2, [11 * MiB])[0])
    w.flush()  # the upload is created, and its first part sent, on the writer's threads
    up = next(u for u in _uploads(store) if u["Key"].endswith("v/lost.dcr"))
    # the server forgets the upload (as an expiry or another client's abort would)
    store.client.abort_multipart_upload(Bucket=store.bucket, Key=up["Key"], UploadId=up["UploadId"])
    with pytest.raises(StoreError):
        w.commit()
    assert not _visible(store, "v/lost.dcr")
    assert [u for u in _uploads(store) if u["Key"].endswith("v/lost.dcr")] == []


def test_a_wrapped_put_stays_the_one_write_path(tmp_path):
    seen = []

    class Audited(LocalStore):
        def put(self, key, data):
            seen.append((key, bytes(data)))
            return super().put(key, data)

    s = Audited(tmp_path / "a")
    w = s.open_writer("k")
    assert isinstance(w, BufferedWriter)
    w.write(b"ab")
    w.write(b"cd")
    assert seen == [] and not s.exists("k")
    w.commit()
    assert seen == [("k", b"abcd")] and s.get("k") == b"abcd"

    class DuckTyped:  # no Store subclass: put() alone
        def __init__(self):
            self.objects = {}

        def put(self, key, data):
            self.objects[key] = data

    d = DuckTyped()
    with open_writer(d, "x") as w:
        w.write(b"123")
    assert d.objects == {"x": b"123"}


def test_a_read_only_store_refuses_a_writer():
    with pytest.raises(StoreError, match="read side only"):
        HttpStore("http://127.0.0.1:9").open_writer("k")


def test_header_totals_are_inspects_counts():
    g = torch.Generator().manual_seed(3)
    base = {"a": torch.randn(300, 7, generator=g).to(torch.bfloat16), "gone": torch.ones(5),
            "i": torch.arange(40, dtype=torch.int64)}
    target = {"a": base["a"].clone(), "new": torch.zeros(3, 3, dtype=torch.float16), "i": base["i"] + 1}
    target["a"].view(-1)[::13] += 1
    import io
    f = io.BytesIO()
    header = diff(base, target, out=f, chunk_elems=256)
    s = inspect(f.getvalue())
    assert totals(header) == (s["elements"], s["changed"], s["dense_bytes"])


def _states(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = {f"w{i}": torch.randn(256, 64, generator=g).to(torch.bfloat16) for i in range(4)}
    out = [s]
    for _ in range(n - 1):
        s = {k: v.clone() for k, v in s.items()}
        for v in s.values():
            v.view(-1)[torch.randint(0, v.numel(), (200,), generator=g)] += 0.01
        out.append(s)
    return out


def test_published_parts_streamed_to_s3_are_what_the_manifest_says(moto_s3, request):
    # 5 MiB multipart parts, objects of 8 MiB of 1 MiB tensors (~5.8 MB coded): the keyframe streams in parts
    store = make_s3_store(moto_s3, request, multipart_threshold=5 * MiB)
    g = torch.Generator().manual_seed(4)
    v0 = {f"w{i:02d}": torch.randn(1024, 512, generator=g).to(torch.bfloat16) for i in range(12)}
    v1 = {k: v.clone() for k, v in v0.items()}
    for v in v1.values():
        v.view(-1)[::97] += 0.5
    pub = Publisher(store, part_bytes=8 * MiB, signer=None)
    r0 = pub.publish(v0)
    r1 = pub.publish(v1, keyframe=True)
    for m in (r0.manifest, r1.manifest):
        for p in m.parts + m.keyframe_parts:
            blob = store.get(p.key)
            assert p.algo == "blake3" and p.sha256 is None  # the default: format-4 manifests
            assert (len(blob), blake3.blake3(blob).hexdigest()) == (p.size, p.checksum)
            s = inspect(blob)
            assert (s["changed"], s["elements"], s["dense_bytes"]) == (p.changed, p.elements, p.dense_bytes)
    assert any(p.size > 5 * MiB for p in r0.manifest.keyframe_parts), "no keyframe part went up in parts"
    assert _uploads(store) == []
    tensors = {}
    Follower(store, tensors, verifier=None).sync()
    for k, v in v1.items():
        assert torch.equal(tensors[k].view(torch.int16), v.view(torch.int16))


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs (root only): a write past it fails with ENOSPC, a real disk-full."""
    path = tmp_path / "disk"
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"no tmpfs: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_a_full_disk_mid_publish_commits_nothing_and_leaves_no_temporaries(small_disk):
    store = LocalStore(small_disk / "s")
    seq = _states(2)
    pub = Publisher(store, signer=None)
    pub.publish(seq[0])  # ~140 KB: fits
    big = {k: torch.randn(512, 1024).to(torch.bfloat16) for k in ("x", "y", "z")}  # 3 MiB of noise
    with pytest.raises(PublishError, match="No space left"):
        pub.publish({**seq[1], **big}, keyframe=True)
    assert read_head(store)[0].version == 0
    assert _leftovers(store.root) == []
    r = pub.publish(seq[1])  # the store and the publisher carry on
    assert r.version == 1
    tensors = {}
    Follower(store, tensors, verifier=None).sync()
    for k, v in seq[1].items():
        assert torch.equal(tensors[k].view(torch.int16), v.view(torch.int16))


def test_retention_drops_what_writers_killed_mid_object_left(store):
    """A writer that never commits nor aborts (its process killed mid-object) leaves a hidden
    temporary or an incomplete multipart upload that no listing shows; retention drops those of
    versions below its cutoff, and leaves the unfinished writes of newer versions alone."""
    seq = _states(4)
    pub = Publisher(store, keyframe_every=2, retain=0, signer=None)
    pub.publish(seq[0])
    old_key, new_key = "versions/000000000000/dead-1/part-00000.dcr", "versions/000000000009/live-1/part-00000.dcr"
    killed = []
    for key in (old_key, new_key):
        w = store.open_writer(key)
        w.write(_pieces(7, [10 * MiB])[0])  # past S3's multipart threshold (8 MiB): an upload is open
        w.flush()
        killed.append(w)  # neither committed nor aborted, as after a SIGKILL

    def unfinished():
        if isinstance(store, LocalStore):
            return sorted(os.path.relpath(p, store.root) for p in _leftovers(store.root))
        return sorted(u["Key"][len(store.prefix) + 1:] for u in _uploads(store))

    assert len(unfinished()) == 2
    for s in seq[1:]:
        pub.publish(s)  # version 2 is a keyframe: the cutoff passes version 0
    left = unfinished()
    assert len(left) == 1 and "000000000009" in left[0], left
    assert not any(k.startswith("versions/000000000000/") for k in store.list("versions/"))
    tensors = {}
    Follower(store, tensors, verifier=None).sync()
    for k, v in seq[-1].items():
        assert torch.equal(tensors[k].view(torch.int16), v.view(torch.int16))
    killed[1].abort()
