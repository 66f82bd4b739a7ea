"""Relay tree: real ``nemo-dcr relay`` processes on 127.0.0.1 between a Publisher's store and
Followers reading through ``http://`` store URLs. Faults (kills, corruption, stalls) are in
test_relay_faults.py; tokens and path traversal in test_relay_security.py."""
import threading

import pytest

from dcr_testing import assert_state, zeros_like
from dcr_testing.relay import RelayProc, model, train_step, wait_until
from nemo_dcr.stores import FallbackStore, HttpStore, NotFound, StoreError, open_store
from nemo_dcr.sync.follower import Follower
from nemo_dcr.sync.publisher import Publisher
from nemo_dcr.sync.retention import prune
from nemo_dcr.sync.versions import read_head

pytest.importorskip("aiohttp")


def test_two_level_tree_serves_two_followers_bit_exact_at_every_version(store):
    """store -> relay A -> relay B; one follower on each relay; both bit-exact at every version,
    and every object crosses each link once."""
    pub = Publisher(store, keyframe_every=3)
    state = model()
    pub.publish(state, step=0)
    env = {"NEMO_DCR_S3_ENDPOINT": store.endpoint_url} if hasattr(store, "endpoint_url") else {}
    a = RelayProc(store.url, env=env)
    b = RelayProc([a.url, store.url], env=env)
    try:
        sa, sb = open_store(a.url), open_store([b.url, a.url, store])
        assert isinstance(sb, FallbackStore) and isinstance(sa, HttpStore)
        fa, fb = Follower(sa, zeros_like(state)), Follower(sb, zeros_like(state))
        for i in range(5):
            if i:
                train_step(state, i)
                pub.publish(state, step=i)
            ra, rb = fa.sync(), fb.sync()
            assert ra.version == rb.version == i
            assert_state(fa.tensors, state)
            assert_state(fb.tensors, state)
        sta, stb = sa.stats(), HttpStore(b.url).stats()
        objects = [k for k in store.list("versions/")]
        # A served B and a follower, B served a follower: each fetched every object it served
        # exactly once from its upstream, and kept it (verified) in its cache
        assert sta["upstream_fetches_by_key"] and set(sta["upstream_fetches_by_key"]) <= set(objects)
        assert all(n == 1 for n in sta["upstream_fetches_by_key"].values()), sta
        assert all(n == 1 for n in stb["upstream_fetches_by_key"].values()), stb
        assert set(stb["upstream_fetches_by_key"]) <= set(sta["upstream_fetches_by_key"])
        assert sta["cache_hits"] + sta["coalesced"] >= len(stb["upstream_fetches_by_key"])
        assert sta["bad_objects"] == stb["bad_objects"] == 0
        # each kept once checked, after its last byte went out (a part read before the relay saw
        # its version's HEAD: once that HEAD, carrying the manifest, is read)
        wait_until(lambda: HttpStore(b.url).stats()["cache_entries"] == len(stb["upstream_fetches_by_key"]),
                   "B to keep every object it fetched")
    finally:
        b.stop()
        a.stop()


def test_many_children_cause_one_upstream_fetch_per_object(tmp_path):
    store = open_store(tmp_path / "store")
    state = model(n=1 << 20)  # a 2 MB keyframe: children join while it is in flight
    Publisher(store).publish(state)
    head, _ = read_head(store)
    m = store.get(head.manifest)
    part = [k for k in store.list("versions/") if k.endswith(".dcr")][0]
    want = store.get(part)
    r = RelayProc(store.url)
    try:
        n, got, errors = 12, {}, []
        barrier = threading.Barrier(n)

        def child(i):
            try:
                s = HttpStore(r.url)
                barrier.wait()
                got[i] = (s.get(head.manifest), s.get(part))
            except Exception as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=child, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors and len(got) == n
        assert all(g == (m, want) for g in got.values())
        st = HttpStore(r.url).stats()
        assert st["upstream_fetches_by_key"] == {head.manifest: 1, part: 1}, st
        assert st["coalesced"] + st["cache_hits"] >= 2 * (n - 1)
        assert st["served_bytes"] >= n * len(want)
    finally:
        r.stop()


def test_http_store_reads_like_any_store_and_refuses_writes(tmp_path):
    store = open_store(tmp_path / "store")
    state = model()
    Publisher(store).publish(state)
    part = [k for k in store.list("versions/") if k.endswith(".dcr")][0]
    data = store.get(part)
    blob = bytes(range(256)) * 4099
    store.put("ckpt/a.bin", blob)
    store.put("ckpt/empty", b"")
    r = RelayProc(store.url, "--prefix", "run1")
    try:
        # objects outside the store's layout (HEAD, versions/...) are not forwarded at all
        s = HttpStore(r.url)
        for key in ("ckpt/a.bin", "ckpt/empty"):
            with pytest.raises(NotFound):
                s.get(key)
        assert s.stats()["cache_entries"] == 0 and s.stats()["upstream_fetches_by_key"] == {}

        assert r.url.endswith("/run1")
        s = open_store(r.url)
        assert s.get(part) == data and s.size(part) == len(data) and s.exists(part)
        assert not s.exists("versions/nope") and s.list("versions/") == store.list("versions/")
        assert s.list() == [k for k in store.list() if not k.startswith("ckpt/")] and "ckpt/a.bin" in store.list()
        with pytest.raises(NotFound):
            s.get("versions/nope")
        size, chunks = s.get_stream(part, 1000)  # ranged: from an offset
        assert size == len(data) and b"".join(chunks) == data[1000:]
        size, chunks = s.get_stream(part, len(data))
        assert size == len(data) and b"".join(chunks) == b""
        s.get_to_file(part, tmp_path / "out" / "p.dcr")
        assert (tmp_path / "out" / "p.dcr").read_bytes() == data
        assert [p.name for p in (tmp_path / "out").iterdir()] == ["p.dcr"]  # no temp left
        assert s.get_with_tag("HEAD") == store.get_with_tag("HEAD")
        for op in (lambda: s.put("x", b"1"), lambda: s.put_if_absent("x", b"1"),
                   lambda: s.put_if_match("x", b"1", "t"), lambda: s.delete(part),
                   lambda: s.put_file("x", tmp_path / "out" / "p.dcr")):
            with pytest.raises(StoreError, match="read side only"):
                op()
        with pytest.raises(StoreError, match="read-only"):
            open_store([r.url, store.url]).put("x", b"1")
        assert store.get(part) == data and not store.exists("x")
        with pytest.raises(NotFound):  # another namespace on the same relay
            HttpStore(r.url.rsplit("/", 1)[0] + "/run2").get(part)
    finally:
        r.stop()


def test_long_poll_answers_when_a_version_is_committed(tmp_path):
    """A child parked on ``HEAD?newer_than=v`` at the bottom of a two-level tree gets the new
    version once it is committed, long before its wait ends; a plain HEAD read is never stale."""
    store = open_store(tmp_path / "store")
    state = model()
    pub = Publisher(store)
    pub.publish(state)
    a = RelayProc(store.url, "--poll-interval", "0.02")
    b = RelayProc(a.url)
    try:
        sa, sb = HttpStore(a.url), HttpStore(b.url, timeout=10)
        events, result = [], {}

        def child():
            result["head"] = sb.wait_head(0, 50)  # must not take the 50 s
            events.append("answered")

        t = threading.Thread(target=child)
        t.start()
        wait_until(lambda: sb.stats()["head_waiters"] == 1, "the child to be parked at B")
        wait_until(lambda: sa.stats()["head_waiters"] == 1, "B's poller to be parked at A")
        assert events == [] and t.is_alive()
        train_step(state, 1)
        events.append("publishing")
        pub.publish(state)
        t.join(30)
        assert not t.is_alive(), "the long poll did not return on the new version"
        assert events == ["publishing", "answered"]
        assert b'"version": 1' in result["head"][0]
        assert sb.get_with_tag("HEAD")[0] == store.get("HEAD")
        # not stale: a HEAD read right after a commit sees it, with no poll in between
        train_step(state, 2)
        pub.publish(state)
        assert sa.get_with_tag("HEAD")[0] == sb.get_with_tag("HEAD")[0] == store.get("HEAD")
        assert sb.wait_head(1, 50)[0] == store.get("HEAD")  # already newer: at once
        f = Follower(sb, zeros_like(state))
        assert f.sync().version == 2
        assert_state(f.tensors, state)
    finally:
        b.stop()
        a.stop()


def test_the_upstream_is_not_listed_while_children_download_a_new_version(tmp_path):
    """The listing that drops versions retention removed waits ``--prune-delay`` seconds after a
    new version: children syncing it meanwhile share the cores and the slow link with nothing
    but their downloads (the test after this one sees the listing come, with a short delay)."""
    store = open_store(tmp_path / "store")
    state = model()
    pub = Publisher(store)
    pub.publish(state)
    r = RelayProc(store.url, "--poll-interval", "0.02", "--prune-delay", "600")
    try:
        s = HttpStore(r.url)
        f = Follower(s, zeros_like(state))
        for i in range(1, 4):
            train_step(state, i)
            pub.publish(state)
            assert s.wait_head(i - 1, 30)[0] == store.get("HEAD")
            assert f.sync().version == i
            assert_state(f.tensors, state)
        st = s.stats()
        assert st["upstream_lists"] == 0 and st["evicted_old_versions"] == 0, st
    finally:
        r.stop()


def test_cache_is_bounded_and_drops_versions_retention_removed(tmp_path):
    store = open_store(tmp_path / "store")
    state = model()
    pub = Publisher(store, keyframe_every=2)
    pub.publish(state)
    sizes = {k: store.size(k) for k in store.list("versions/")}
    cap = max(sizes.values()) + 4096
    r = RelayProc(store.url, "--cache-max-bytes", cap, "--poll-interval", "0.02", "--prune-delay", "0.2")
    try:
        s = HttpStore(r.url)
        f = Follower(s, zeros_like(state))
        for i in range(1, 5):
            f.sync()
            st = s.stats()
            assert 0 < st["cache_bytes"] <= cap, st
            train_step(state, i)
            pub.publish(state)
        f.sync()
        assert_state(f.tensors, state)
        head, _ = read_head(store)
        assert prune(store, head)  # the keyframe at 4 stays; 0..3 go
        oldest = min(int(k.split("/")[1]) for k in store.list("versions/"))
        assert oldest == 4
        train_step(state, 5)
        pub.publish(state)
        s.wait_head(4, 0)  # the relay sees version 5 and lists what the store still holds
        f.sync()
        assert_state(f.tensors, state)
        wait_until(lambda: s.stats()["evicted_old_versions"] > 0, "the relay to drop old versions")
        st = s.stats()
        assert st["cache_bytes"] <= cap
    finally:
        r.stop()
