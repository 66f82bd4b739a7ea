"""Downloads paced by the bandwidth-delay product (issue 25, nemo_dcr/sync/pace.py): the rule on a
fake clock, then on a simulated link against its two alternatives (every download at once, one
after the other), then a real follower through a real relay behind a shaped link."""
from __future__ import annotations

import pytest

from nemo_dcr.sync.pace import INITIAL_WINDOW, LinkEstimate, Pacer

KB, MB = 1 << 10, 1 << 20


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_estimates_from_the_downloads():
    clock = Clock()
    p = Pacer(clock=clock)
    p.started(0, 4 * MB)
    clock.t = 0.030
    p.received(0, 64 * KB)  # the first bytes: the round trip, not counted as bandwidth
    assert p.link.rtt == pytest.approx(0.030) and p.link.bandwidth is None
    for k in range(2, 33):  # 10 MB/s
        clock.t += 64 * KB / 10e6
        p.received(0, k * 64 * KB)
    assert p.link.bandwidth == pytest.approx(10e6)
    assert p.link.bdp() == pytest.approx(0.030 * 10e6)
    # a second download receiving at the same time shares the link: counted once
    p.started(1, 4 * MB)
    clock.t += 0.030
    p.received(1, 64 * KB)
    for k in range(33, 65):
        clock.t += 64 * KB / 10e6
        p.received(0 if k % 2 else 1, (k // 2 + 1) * 64 * KB + (0 if k % 2 else 64 * KB))
    assert p.link.bandwidth == pytest.approx(10e6, rel=0.35)
    p.received(0, 10)  # a retry: its bytes again from the start, nothing counted twice
    assert p._running[0].got == 10


def test_a_read_sent_earlier_is_not_measured():
    """A read sent beside HEAD (sync/speculate.py) has its bytes waiting: its time to a first
    byte is no round trip. Counted before, one such read put the round trip near 0, so every
    later download waited for the running ones to end (the 5 % rows at +40 ms: 210 -> 251 ms).
    What it receives after its first read counts as bandwidth, as any download's."""
    clock = Clock()
    p = Pacer(clock=clock)
    p.started(0, 2 * MB, early=True)
    clock.t = 0.0001
    p.received(0, 1 * MB)
    assert p.link.rtt is None and p.link.bandwidth is None
    clock.t = 0.1001
    p.received(0, 2 * MB)
    assert p.link.rtt is None and p.link.bandwidth == pytest.approx(10 * MB)
    p.started(1, 2 * MB, early=True)
    assert p.left() == 2 * MB  # its bytes to come still count in the window
    p.ended(0)
    p.ended(1)
    clock.t = 0.2
    p.started(2, 4 * MB)
    clock.t = 0.24
    p.received(2, 64 * KB)
    assert p.link.rtt == pytest.approx(0.04)


def test_the_next_download_starts_with_about_a_bdp_left():
    clock = Clock()
    p = Pacer(clock=clock)
    assert p.ready()  # nothing running
    p.started(0, 2 * INITIAL_WINDOW)
    assert not p.ready()  # more than the initial window left, nothing known
    clock.t = 0.010
    got = 16 * KB
    p.received(0, got)
    while got < 2 * INITIAL_WINDOW and not p.ready():  # 10 MB/s, 10 ms: a BDP of 100 KB
        clock.t += 16 * KB / 10e6
        got += 16 * KB
        p.received(0, got)
    assert p.ready() and p.left() == pytest.approx(0.010 * 10e6, abs=16 * KB)


def test_before_the_link_is_known_small_objects_start_together():
    p = Pacer(clock=Clock())
    n = 0
    while p.ready() and n < 100:
        p.started(n, 100 * KB)
        n += 1
    assert n == INITIAL_WINDOW // (100 * KB) + 1


def simulate(sizes, rtt, bandwidth, policy, reads=16 * KB, ahead=4, dt=1e-4):
    """Downloads of ``sizes`` over a link of ``rtt`` and ``bandwidth`` (bytes/s, shared evenly by
    the downloads receiving), started in order as ``policy(running)`` allows, at most ``ahead``
    running: -> (when the first ended, when the last ended). Deterministic: a fixed time step."""
    clock = Clock()
    pacer = Pacer(LinkEstimate(), clock)
    pending, running, ended, nxt = list(range(len(sizes))), {}, {}, 0
    while len(ended) < len(sizes):
        while nxt < len(sizes) and len(running) < ahead and policy(pacer, running):
            running[nxt] = {"t0": clock.t, "got": 0.0, "told": 0}
            pacer.started(nxt, sizes[nxt])
            nxt += 1
        clock.t += dt
        receiving = [i for i, d in running.items() if clock.t - d["t0"] >= rtt]
        for i in receiving:
            d = running[i]
            d["got"] = min(sizes[i], d["got"] + bandwidth * dt / len(receiving))
            if d["got"] - d["told"] >= reads or d["got"] == sizes[i]:
                d["told"] = int(d["got"])
                pacer.received(i, d["told"])
            if d["got"] == sizes[i]:
                pacer.ended(i)
                ended[i] = clock.t
                del running[i]
    del pending
    return ended[0], max(ended.values())


def paced(pacer, running):
    return pacer.ready()


def at_once(pacer, running):
    return True


def one_by_one(pacer, running):
    return not running


@pytest.mark.parametrize("rtt, bandwidth, size", [
    (0.001, 25e6, 2 * MB),   # 200 Mbit/s, 1 ms: a BDP of 25 KB, objects of 2 MB
    (0.040, 25e6, 4 * MB),   # 200 Mbit/s, +40 ms: a BDP of 1 MB
    (0.001, 125e6, 4 * MB),  # 1 Gbit/s, 1 ms
])
def test_on_a_bandwidth_bound_link_the_first_object_comes_early_and_the_link_stays_busy(rtt, bandwidth, size):
    sizes = [size] * 6
    first_p, last_p = simulate(sizes, rtt, bandwidth, paced)
    first_a, last_a = simulate(sizes, rtt, bandwidth, at_once)
    first_s, last_s = simulate(sizes, rtt, bandwidth, one_by_one)
    assert first_p <= first_s * 1.02 + 1e-3  # as early as alone on the link ...
    assert first_p < first_a / 2             # ... not shared with the others
    assert last_p <= last_a * 1.03 + 1e-3    # and no round trip left idle
    assert last_s > last_p + 3 * rtt        # (one by one leaves them idle)


@pytest.mark.parametrize("rtt, bandwidth, size", [
    (0.040, 125e6, 256 * KB),  # 1 Gbit/s, +40 ms: a BDP of 5 MB, objects of 256 KB
    (0.100, 25e6, 2 * MB),     # 200 Mbit/s, +100 ms: a BDP of 2.5 MB
])
def test_on_a_latency_bound_link_the_round_trips_overlap(rtt, bandwidth, size):
    sizes = [size] * 8
    _, last_p = simulate(sizes, rtt, bandwidth, paced)
    _, last_a = simulate(sizes, rtt, bandwidth, at_once)
    _, last_s = simulate(sizes, rtt, bandwidth, one_by_one)
    assert last_p <= last_a * 1.1 + rtt / 4
    assert last_p < last_s * 0.6


# ----------------------------------------------------------------------------- end to end

def _overlap(spans, keys) -> int:
    """The most fetches of ``keys`` under way at once (each key's first fetch span)."""
    fetch = {}
    for s in spans:
        if s.stage == "fetch" and s.what in keys and s.what not in fetch:
            fetch[s.what] = (s.start, s.end)
    assert set(fetch) == set(keys)
    return max(sum(1 for a, b in fetch.values() if a <= t < b) for t, _ in fetch.values())


@pytest.mark.parametrize("mbit, rtt", [(40.0, 0.0), (None, 0.2)], ids=["bandwidth-bound", "latency-bound"])
def test_a_follower_paces_its_downloads_through_a_relay_over_a_shaped_link(tmp_path, mbit, rtt):
    """A real follower, a real relay process over a local store, the relay reached through the
    benchmarks' shaped link (a rate-limiting, delaying TCP proxy): four parts of 1.5 MB. At 40
    Mbit/s (a BDP of a few KB) they come one after the other, the first before the third starts;
    with +200 ms and no rate limit (a BDP of MBs) they are under way together. (Before: up to
    ``prefetch`` at once whatever the link.)"""
    import torch

    from dcr_testing import assert_state
    from dcr_testing import bench as benches
    from dcr_testing.relay import RelayProc
    from nemo_dcr.stores import HttpStore, LocalStore
    from nemo_dcr.sync.follower import Follower
    from nemo_dcr.sync.publisher import Publisher

    g = torch.Generator().manual_seed(0)
    bits = lambda: torch.randint(-(1 << 31), 1 << 31, (384 << 10,), dtype=torch.int32, generator=g)  # noqa: E731
    v0 = {f"t{i}": bits() for i in range(4)}
    v1 = {k: bits() for k in v0}  # every element changed, incompressibly
    store = LocalStore(tmp_path / "s")
    pub = Publisher(store, part_bytes=1)  # one tensor a part
    pub.publish(v0)
    m = pub.publish(v1).manifest
    parts = [p.key for p in m.parts]
    assert len(parts) == 4 and all(p.size > 1.4 * MB for p in m.parts)
    ne = benches.load("netenv")
    region = ne.Region(shaping="proxy", rtt=rtt)
    relay = RelayProc(store.url)
    try:
        region.shape(mbit)
        held = {k: v.clone() for k, v in v0.items()}
        f = Follower(HttpStore(region.reach(relay.url)), held, version=0, verify_initial=False, prefetch=4)
        r = f.sync()
        assert r.version == 1
        assert_state(held, v1)
        most = _overlap(r.spans, parts)
        if mbit:
            assert most <= 2
            first_end = next(s.end for s in r.spans if s.stage == "fetch" and s.what == parts[0])
            third_start = next(s.start for s in r.spans if s.stage == "fetch" and s.what == parts[2])
            assert first_end <= third_start
        else:
            assert most >= 3 and f.link.bdp() > 1.5 * MB
    finally:
        relay.stop()
        region.close()


def test_an_s3_download_passes_on_what_arrived(moto_s3, request):
    """S3 behind a slow link (the benchmarks' rate-limited proxy, 8 Mbit/s): get_stream yields
    the bytes as they come, not in whole MiBs (botocore's iter_chunks waited for each: a 600 KB
    object came in one piece at its end, so neither a streaming apply nor the pacing saw it
    arrive)."""
    from dcr_testing import bench as benches
    from dcr_testing.s3 import make_s3_store
    from nemo_dcr.stores import S3Store

    data = bytes(range(256)) * (600 << 2)  # 600 KiB
    plain = make_s3_store(moto_s3, request)
    plain.put("obj", data)
    ne = benches.load("netenv")
    region = ne.Region(shaping="proxy")
    try:
        region.shape(8.0)
        slow = S3Store(moto_s3.bucket, plain.prefix, endpoint_url=region.reach(moto_s3.endpoint_url),
                       max_attempts=2, retries=1)
        size, chunks = slow.get_stream("obj")
        got = list(chunks)
        assert size == len(data) and b"".join(got) == data
        assert len(got) >= 4, [len(b) for b in got]
    finally:
        region.close()
