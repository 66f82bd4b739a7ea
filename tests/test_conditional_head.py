"""Polling an unchanged HEAD is a conditional read (issue 25). From format 3 HEAD carries the
newest manifest (1.3-16 KB), and a follower outside a relay reads it every ``poll_interval``:
20-30 KB/s each across the slow link. With ``If-None-Match`` an unchanged HEAD costs a 304's
headers, on S3 (a real S3 server over HTTP, behind the benchmarks' byte-counting proxy) and
through a relay (a real relay process), and a changed one is read whole as before."""
from __future__ import annotations

import pytest
import torch

from dcr_testing import bench as benches
from dcr_testing.s3 import make_s3_store
from nemo_dcr.stores import HttpStore, NotFound, S3Store, Store
from nemo_dcr.sync.follower import Follower
from nemo_dcr.sync.publisher import Publisher
from nemo_dcr.sync.versions import HEAD_KEY


def model(step: int) -> dict:
    """Many small tensors in many parts: a HEAD of several KB, as a real model's is."""
    g = torch.Generator().manual_seed(step)
    return {f"layers.{i}.w": torch.randn(1024, generator=g).to(torch.bfloat16) for i in range(48)}


def test_get_if_changed(store: Store):
    store.put("k", b"one")
    data, tag = store.get_with_tag("k")
    assert store.get_if_changed("k", tag) is None
    store.put("k", b"two")
    got = store.get_if_changed("k", tag)
    assert got is not None and got[0] == b"two" and got == store.get_with_tag("k")
    assert store.get_if_changed("k", got[1]) is None
    with pytest.raises(NotFound):
        store.get_if_changed("absent", tag)


def test_polling_an_unchanged_head_over_s3_moves_headers_only(moto_s3, request):
    plain = make_s3_store(moto_s3, request)
    pub = Publisher(plain, part_bytes=2 << 10)
    pub.publish(model(0))
    head_bytes = len(plain.get(HEAD_KEY))
    assert head_bytes > 4000, head_bytes  # the point of the test: a HEAD much larger than headers
    region = benches.load("netenv").Region(shaping="proxy")
    try:
        far = S3Store(moto_s3.bucket, plain.prefix, endpoint_url=region.reach(moto_s3.endpoint_url))
        f = Follower(far, {k: torch.zeros_like(v) for k, v in model(0).items()})

        def bytes_of(fn):
            before = region.slow_bytes()
            out = fn()
            return out, region.slow_bytes() - before

        head, first = bytes_of(f.read_head)
        assert head.version == 0 and first > head_bytes
        for _ in range(3):
            again, cost = bytes_of(f.read_head)
            assert again is head  # the bytes held, not read again
            assert cost < 1000 < head_bytes, (cost, head_bytes)
        res, cost = bytes_of(lambda: f.wait(newer_than=0, timeout=0.3, poll_interval=0.1))
        assert res is None and cost < 1000 * 4  # at most 4 polls, each headers only

        pub.publish(model(1))
        new_bytes = len(plain.get(HEAD_KEY))
        head1, cost = bytes_of(lambda: f.wait(newer_than=0, timeout=10))
        assert head1.version == 1 and cost > new_bytes  # a changed HEAD is read whole
        assert f.sync(head=head1).version == 1
    finally:
        region.close()


def test_a_relay_answers_an_unchanged_head_with_304(tmp_path):
    pytest.importorskip("aiohttp")
    from dcr_testing.relay import RelayProc

    store_dir = tmp_path / "store"
    pub = Publisher(str(store_dir), part_bytes=2 << 10)
    pub.publish(model(0))
    parent = RelayProc(str(store_dir))
    child = RelayProc(parent.url)  # reads its upstream's HEAD conditionally too
    try:
        for relay in (parent, child):
            s = HttpStore(relay.url)
            pair = s.get_with_tag(HEAD_KEY)
            assert s.get_if_changed(HEAD_KEY, pair[1]) is None
            assert s.wait_head(0, 0.05, pair) is pair  # a long poll that ends with nothing new
        # the child's reads of the parent found HEAD unchanged after the first
        assert HttpStore(parent.url).stats()["head_not_modified"] >= 3
        assert HttpStore(child.url).stats()["head_not_modified"] == 2

        pub.publish(model(1))
        f = Follower(child.url, {k: torch.zeros_like(v) for k, v in model(0).items()})
        got = f.wait(newer_than=0, timeout=10)
        assert got is not None and got.version == 1
        assert f.sync(head=got).version == 1
    finally:
        child.stop()
        parent.stop()
