"""The streaming pipeline: the follower downloads the next object while the previous one is
applied (and never writes a version before its objects checked out, unless ``stream=True``),
the publisher uploads one object while encoding the next, both record per-stage spans, and
``Follower.wait`` learns of a new version from a relay's long poll.

Overlap is shown without timing: a store or a tensor mapping holds one stage until the other
stage has begun; without the pipeline that never happens and the bounded wait runs out."""
import hashlib
import threading
from collections.abc import MutableMapping

import pytest
import torch

from dcr_testing import assert_bits_equal
from nemo_dcr.codec import format as fmt
from nemo_dcr.codec.format import DeltaReader
from nemo_dcr.delta import diff
from nemo_dcr.errors import CorruptObjectError
from nemo_dcr.state.statedigest import state_contrib
from nemo_dcr.stores import LocalStore
from nemo_dcr.sync.follower import Follower
from nemo_dcr.sync.publisher import Publisher
from nemo_dcr.sync.versions import Manifest, Part, commit, new_publish_id, read_head, read_manifest, version_dir

GATE = 10.0  # seconds a gated stage waits for the stage it should overlap with


def states(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = {"a": torch.randn(64, 128, generator=g).bfloat16(), "b": torch.randn(4096, generator=g).bfloat16(),
         "c": torch.randn(33, generator=g)}
    out = [{k: v.clone() for k, v in s.items()}]
    for _ in range(1, n):
        s = {k: v.clone() for k, v in s.items()}
        for v in s.values():
            flat = v.view(-1)
            idx = torch.randperm(flat.numel(), generator=g)[: max(1, flat.numel() // 30)]
            flat[idx] = torch.randn(len(idx), generator=g).to(v.dtype)
        out.append(s)
    return out


def publish_all(store, seq, **kw):
    pub = Publisher(store, **kw)
    return [pub.publish(s) for s in seq]


class RecordingStore(LocalStore):
    """A real LocalStore that notes when each object's download starts."""

    def __init__(self, root):
        super().__init__(root)
        self.started = {}

    def get_stream(self, key, offset=0):
        self.started.setdefault(key, threading.Event()).set()
        return super().get_stream(key, offset)

    def event(self, key):
        return self.started.setdefault(key, threading.Event())


class GatedTensors(MutableMapping):
    """The receiver's tensors; the first access waits (bounded) for ``gate``: the apply of the
    first object is held until the download of the next one has begun."""

    def __init__(self, gate: threading.Event):
        self.d, self.gate, self.opened = {}, gate, None

    def _wait(self):
        if self.opened is None:
            self.opened = self.gate.wait(GATE)

    def __getitem__(self, k):
        self._wait()
        return self.d[k]

    def __setitem__(self, k, v):
        self._wait()
        self.d[k] = v

    def __delitem__(self, k):
        del self.d[k]

    def __iter__(self):
        self._wait()
        return iter(self.d)

    def __len__(self):
        return len(self.d)


def test_next_object_downloads_while_the_first_is_applied(tmp_path):
    store = RecordingStore(tmp_path / "s")
    seq = states(3)
    res = publish_all(store, seq)
    second = res[1].manifest.parts[0].key  # path: keyframe 0 + deltas 1..2
    tensors = GatedTensors(store.event(second))
    r = Follower(store, tensors).sync()
    assert tensors.opened, "the keyframe was applied before the next object's download began"
    assert r.version == 2 and r.path == "keyframe 0 + deltas 1..2"
    for k, v in seq[2].items():
        assert_bits_equal(tensors.d[k], v)
    stages = {s.stage for s in r.spans}
    assert {"fetch", "verify", "apply", "digest"} <= stages
    assert all(0 <= s.start <= s.end <= r.seconds for s in r.spans)
    fetched = [s.what for s in r.spans if s.stage == "fetch"]  # each object once (finishing in any order)
    assert sorted(fetched) == sorted([p.key for p in res[0].manifest.keyframe_parts] +
                                     [p.key for x in res[1:] for p in x.manifest.parts])


class HeldFirstStore(LocalStore):
    """The download of the first object whose key contains ``hold`` does not begin (bounded)
    until the download of a key containing ``until`` began: only possible when two downloads are
    in flight at once."""

    def __init__(self, root, hold, until):
        super().__init__(root)
        self.hold, self.until = hold, until
        self.until_started, self.overlapped = threading.Event(), None

    def get_stream(self, key, offset=0):
        if self.until in key:
            self.until_started.set()
        if self.hold in key and self.overlapped is None:
            self.overlapped = self.until_started.wait(GATE)
        return super().get_stream(key, offset)


@pytest.mark.parametrize("prefetch", [1, 2])
def test_downloads_overlap_their_round_trips_and_arrive_in_order(tmp_path, prefetch):
    """With prefetch=2 the second object's request goes out while the first one's is pending,
    and the first is still applied first; prefetch=1 is the control (one at a time)."""
    seq = states(2)
    store = HeldFirstStore(tmp_path / "s", hold="/part-00000.dcr", until="/part-00000.1.dcr")
    res = publish_all(store, seq, part_bytes=4096, delta_part_bytes=4096)
    assert len(res[1].manifest.parts) == 3
    if prefetch == 1:
        store.until_started.wait = lambda t: store.until_started.is_set()  # do not sit out the bound
    held = {k: v.clone() for k, v in seq[0].items()}
    r = Follower(store, held, version=0, prefetch=prefetch).sync()
    assert store.overlapped is (prefetch == 2)
    assert r.version == 1
    for k, v in seq[1].items():
        assert_bits_equal(held[k], v)
    applied = [s.what for s in r.spans if s.stage == "apply"]
    assert applied == [p.key for p in res[1].manifest.parts]


def test_without_prefetch_nothing_overlaps(tmp_path):
    # the control for the test above: prefetch=0 downloads each object when it is applied
    store = RecordingStore(tmp_path / "s")
    seq = states(3)
    res = publish_all(store, seq)
    tensors = GatedTensors(store.event(res[1].manifest.parts[0].key))
    tensors.gate.wait = lambda t: tensors.gate.is_set()  # do not sit out the bound: just look
    r = Follower(store, tensors, prefetch=0).sync()
    assert tensors.opened is False and r.version == 2
    for k, v in seq[2].items():
        assert_bits_equal(tensors.d[k], v)


def _corrupt(store, key):
    path = store._path(key)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x10
    open(path, "wb").write(bytes(data))


def test_prefetched_corrupt_object_writes_nothing_of_its_version(tmp_path):
    store = LocalStore(tmp_path / "s")
    seq = states(3)
    res = publish_all(store, seq)
    tensors = {k: v.clone() for k, v in seq[0].items()}
    f = Follower(store, tensors, version=0, retries=1, backoff=0.0)
    _corrupt(store, res[2].manifest.parts[0].key)
    with pytest.raises(CorruptObjectError, match="part-00000"):
        f.sync()
    # delta 1 checked out and was applied; delta 2 (prefetched, corrupt) wrote nothing
    assert f.version == 1
    for k, v in seq[1].items():
        assert_bits_equal(tensors[k], v)


def _two_part_version(store, base, new):
    """Version 1 published as two parts (as two trainer ranks would): tensor a in one, b and c
    in the other."""
    head, tag = read_head(store)
    prev = read_manifest(store, head.manifest, head.manifest_sha256)
    pid = new_publish_id()
    parts = []
    for rank, names in enumerate((["a"], ["b", "c"])):
        blob = diff({k: base[k] for k in names}, {k: new[k] for k in names},
                    meta={"version": 1, "publish_id": pid, "rank": rank})
        key = f"{version_dir(1, pid)}/part-{rank:05d}.dcr"
        store.put(key, blob)
        parts.append(Part(rank=rank, key=key, size=len(blob), sha256=hashlib.sha256(blob).hexdigest()))
    m = Manifest(version=1, publish_id=pid, target_digest=state_contrib(new, {}).hex(), base_version=0,
                 base_manifest=prev.key, base_digest=prev.target_digest, base_sha256=prev.sha256, parts=parts,
                 world_size=2)
    commit(store, m, head, tag)
    return m


@pytest.mark.parametrize("bad", [1, 0])
@pytest.mark.parametrize("stream", [False, True])
def test_two_parts_stream_or_check_all_first(tmp_path, stream, bad):
    """One of a version's two parts is corrupt in the store. Checked first (the default), nothing
    is written. Streaming, the version is pending: part 0 was applied before a bad part 1
    arrived; with part 0 bad, part 1 (streamed beside it) may be written by then. Once the
    object is repaired the next sync finishes the version."""
    store = LocalStore(tmp_path / "s")
    seq = states(2)
    publish_all(store, seq[:1], format_version=4)  # state digests of definition 1, as _two_part_version's
    m = _two_part_version(store, seq[0], seq[1])
    good = store.get(m.parts[bad].key)
    _corrupt(store, m.parts[bad].key)
    tensors = {k: v.clone() for k, v in seq[0].items()}
    f = Follower(store, tensors, version=0, retries=0, stream=stream)
    with pytest.raises(CorruptObjectError, match=f"part-0000{bad}"):
        f.sync()
    if stream:
        assert f.version is None
        if bad == 1:
            assert_bits_equal(tensors["a"], seq[1]["a"])
    else:  # every part is checked before the first write: nothing changed
        assert f.version == 0
        for k, v in seq[0].items():
            assert_bits_equal(tensors[k], v)
    store.put(m.parts[bad].key, good)  # the object repaired: the next sync finishes the version
    r = f.sync()
    assert f.version == 1 and r.version == 1
    for k, v in seq[1].items():
        assert_bits_equal(tensors[k], v)
    f.check()


class DamagedOnceStore(LocalStore):
    """The first download of each object whose key contains ``damage`` arrives with one byte
    flipped at ``at`` of its size (bytes damaged on the way; the object in the store is good),
    and ends only once ``seen`` is set (bounded): the receiver has read what arrived."""

    def __init__(self, root, damage, at=0.5):
        super().__init__(root)
        self.damage, self.at, self.damaged = damage, at, set()
        self.seen = threading.Event()

    def get_stream(self, key, offset=0):
        size, chunks = super().get_stream(key, offset)
        if self.damage not in key or key in self.damaged:
            return size, chunks
        self.damaged.add(key)
        data = bytearray(b"".join(chunks))
        data[int(len(data) * self.at)] ^= 0x10

        def damaged():
            yield from (bytes(data[i:i + 1024]) for i in range(0, len(data), 1024))
            self.seen.wait(GATE)
        return size, damaged()


@pytest.mark.parametrize("at", [0.3, 0.5, 0.9])
def test_a_part_damaged_on_the_way_is_downloaded_again_while_streaming(tmp_path, monkeypatch, at):
    """A streaming follower applies a format-3 part segment by segment; a byte damaged on the
    way fails a segment's checksum (index or chunk) before that segment writes: the download is
    retried (the object's sha256) and the part finished from the good copy, the segments applied
    before skipped by the journal. Before, the format error ended the sync."""
    store = DamagedOnceStore(tmp_path / "s", damage="/part-00000.dcr", at=at)
    real = Follower._apply_arriving

    def arriving(self, *a, **kw):  # the damaged download ends once the stream is done with it
        try:
            return real(self, *a, **kw)
        finally:
            store.seen.set()
    monkeypatch.setattr(Follower, "_apply_arriving", arriving)
    seq = states(2)
    res = publish_all(store, seq)
    assert DeltaReader.open(store.get(res[1].manifest.parts[0].key)).version >= 3  # segmented
    held = {k: v.clone() for k, v in seq[0].items()}
    f = Follower(store, held, version=0, stream=True, retries=1, backoff=0.0)
    r = f.sync()
    assert r.version == 1 and store.damaged == {res[1].manifest.parts[0].key}
    for k, v in seq[1].items():
        assert_bits_equal(held[k], v)
    f.check()


def test_a_later_part_damaged_on_the_way_while_the_parts_stream_together(tmp_path, monkeypatch):
    """A delta in three parts, downloading and applied at once: the second part arrives with a
    damaged byte. Its stream stops at the segment that fails its checksum, the other parts are
    applied as they come, the damaged part is downloaded again and finished from the good copy
    (its journal skips what was written), and the receiver ends at the target."""
    store = DamagedOnceStore(tmp_path / "s", damage="/part-00000.1.dcr", at=0.6)
    real = Follower._apply_arriving

    def arriving(self, p, *a, **kw):  # the damaged download ends once its stream is done with it
        try:
            return real(self, p, *a, **kw)
        finally:
            if store.damage in p.key:
                store.seen.set()
    monkeypatch.setattr(Follower, "_apply_arriving", arriving)
    monkeypatch.setattr(fmt, "SEGMENT_BYTES", 32)  # several segments a part: some written before the damage
    seq = states(2)
    res = publish_all(store, seq, part_bytes=4096, delta_part_bytes=4096, chunk_elems=256)
    parts = [p.key for p in res[1].manifest.parts]
    assert len(list(fmt.SegmentStream(memoryview(store.get(parts[1]))).ready(res[1].manifest.parts[1].size))) > 2
    assert len(parts) == 3 and parts[1].endswith(store.damage)
    held = {k: v.clone() for k, v in seq[0].items()}
    f = Follower(store, held, version=0, stream=True, retries=1, backoff=0.0)
    r = f.sync()
    assert r.version == 1 and store.damaged == {parts[1]}
    assert {s.what for s in r.spans if s.stage == "apply"} == set(parts)
    for k, v in seq[1].items():
        assert_bits_equal(held[k], v)
    f.check()


class GatedPutStore(LocalStore):
    """The upload of the first object whose key contains ``hold`` waits (bounded) until an
    upload of a key containing ``until`` began: only possible when that object was encoded while
    the first uploaded. Default: the delta part waits for the keyframe part."""

    def __init__(self, root, hold="/part-", until="/key-"):
        super().__init__(root)
        self.hold, self.until = hold, until
        self.key_started, self.overlapped = threading.Event(), None

    def put(self, key, data):
        if self.until in key:
            self.key_started.set()
        if self.hold in key and self.overlapped is None:
            self.overlapped = self.key_started.wait(GATE)
        return super().put(key, data)


def test_publisher_uploads_the_delta_while_encoding_the_keyframe(tmp_path):
    store = GatedPutStore(tmp_path / "s")
    seq = states(2)
    pub = Publisher(store)
    pub.publish(seq[0])
    r = pub.publish(seq[1], keyframe=True)
    assert store.overlapped, "the keyframe was not encoded while the delta uploaded"
    spans = {(s.stage, s.what): s for s in r.spans}
    assert ("encode", "delta part 0") in spans and ("encode", "keyframe part 0") in spans
    ups = [s for s in r.spans if s.stage == "upload"]
    commit_span = [s for s in r.spans if s.stage == "commit"]
    assert len(ups) == 2 and len(commit_span) == 1
    assert all(u.end <= commit_span[0].start for u in ups), "the commit came before an upload ended"
    tensors = {}
    Follower(store, tensors).sync()
    for k, v in seq[1].items():
        assert_bits_equal(tensors[k], v)


def test_publisher_upload_failure_commits_nothing(tmp_path):
    class Failing(LocalStore):
        def put(self, key, data):
            if "/part-" in key:
                raise OSError("injected upload failure")
            return super().put(key, data)

    store = Failing(tmp_path / "s")
    seq = states(2)
    pub = Publisher(store)
    pub.publish(seq[0])
    with pytest.raises(Exception, match="injected upload failure"):
        pub.publish(seq[1], keyframe=True)
    assert read_head(store)[0].version == 0


def test_wait_on_a_plain_store(tmp_path):
    store = LocalStore(tmp_path / "s")
    seq = states(2)
    pub = Publisher(store)
    pub.publish(seq[0])
    tensors = {}
    f = Follower(store, tensors)
    assert f.wait(timeout=0).version == 0  # nothing held: any version is new
    f.sync()
    assert f.wait(timeout=0.05, poll_interval=0.01) is None
    pub.publish(seq[1])
    head = f.wait(timeout=5)
    assert head.version == 1
    f.sync(head=head)
    for k, v in seq[1].items():
        assert_bits_equal(tensors[k], v)


def test_wait_long_polls_a_relay(tmp_path):
    pytest.importorskip("aiohttp")
    from dcr_testing.relay import RelayProc
    from nemo_dcr.stores.http import HttpStore

    store = LocalStore(tmp_path / "s")
    seq = states(2)
    pub = Publisher(store)
    pub.publish(seq[0])
    relay = RelayProc(str(tmp_path / "s"), "--poll-interval", "0.05")
    try:
        tensors = {}
        f = Follower(HttpStore(relay.url), tensors)
        f.sync()
        got = {}
        t = threading.Thread(target=lambda: got.setdefault("head", f.wait(timeout=60)))
        t.start()
        pub.publish(seq[1])
        t.join(90)
        assert not t.is_alive() and got["head"] is not None and got["head"].version == 1
        r = f.sync(head=got["head"])
        assert r.version == 1
        for k, v in seq[1].items():
            assert_bits_equal(tensors[k], v)
    finally:
        relay.stop()


def test_split_parts_groups_whole_tensors_in_order():
    from nemo_dcr.sync.publisher import split_parts
    t = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in (("a", 100), ("b", 300), ("c", 50), ("d", 10))}
    assert split_parts({}, t, 0) == [["a", "b", "c", "d"]]
    assert split_parts({}, t, 250) == [["a"], ["b"], ["c", "d"]]  # a tensor over the size is a part alone
    assert split_parts({}, t, 1 << 20) == [["a", "b", "c", "d"]]
    assert split_parts({"gone": torch.zeros(999)}, t, 250) == [["a"], ["b"], ["c", "d", "gone"]]  # removed: 0 bytes
    assert split_parts({}, {}, 250) == [[]]


@pytest.mark.parametrize("stream", [False, True])
def test_split_versions_apply_bit_exactly_part_by_part(tmp_path, stream):
    """part_bytes small: each version's delta and keyframe are several objects (whole tensors);
    a tensor removed, one added and one re-typed on the way. A receiver from the keyframe and one
    following the deltas both end bit-exact, fetching every part once, in order."""
    store = LocalStore(tmp_path / "s")
    seq = states(3)
    seq[2] = {k: v.clone() for k, v in seq[2].items() if k != "b"}
    seq[2]["c"] = seq[2]["c"].double()
    seq[2]["z"] = torch.arange(7, dtype=torch.int32)
    res = publish_all(store, seq, part_bytes=4096, delta_part_bytes=4096, keyframe_every=2)
    # a: 16 KiB, b: 8 KiB, c: 132 B -> three parts of whole tensors each
    assert len(res[0].manifest.keyframe_parts) == 3 and len(res[1].manifest.parts) == 3
    assert [p.key.rsplit("/", 1)[1] for p in res[1].manifest.parts] == \
        ["part-00000.dcr", "part-00000.1.dcr", "part-00000.2.dcr"]
    assert len(res[2].manifest.keyframe_parts) >= 2
    held = {k: v.clone() for k, v in seq[0].items()}
    r = Follower(store, held, version=0, stream=stream).sync()
    assert r.version == 2 and set(held) == set(seq[2])
    for k, v in seq[2].items():
        assert_bits_equal(held[k], v)
    # each part fetched once (downloads run concurrently, so they may finish out of order; the
    # feed hands them over in the plan's order or raises)
    fetched = [s.what for s in r.spans if s.stage == "fetch"]
    assert sorted(fetched) == sorted(p.key for x in res[1:] for p in x.manifest.parts)
    fresh = {}
    r = Follower(store, fresh, stream=stream).sync()
    assert r.path == "keyframe 2" and set(fresh) == set(seq[2])
    for k, v in seq[2].items():
        assert_bits_equal(fresh[k], v)


@pytest.mark.parametrize("fails", [False, True])
def test_each_header_is_parsed_once_on_its_download_thread(tmp_path, monkeypatch, fails):
    """A step that opens its objects whole (``stream=False``) parses each header on the thread
    that downloaded it, as the object checks out (a ``parse`` span each), and the step takes
    that reader instead of parsing the object again after all downloads. "fails": a parse off
    the calling thread that raises is not the end of it: the step parses the object itself, as
    before (its error, had it one, raised there, in order), and the sync ends bit for bit."""
    import importlib
    fmod = importlib.import_module("nemo_dcr.sync.follower")
    store = LocalStore(tmp_path / "s")
    seq = states(3)
    res = publish_all(store, seq, part_bytes=4096, delta_part_bytes=4096, keyframe_every=100)
    parts = [p.key for x in res[1:] for p in x.manifest.parts]
    assert len(parts) == 6  # two deltas of three parts each
    main = threading.get_ident()
    opened = []  # (on the calling thread, object size)
    real_open = fmod.DeltaReader.open

    def open_(src):
        if isinstance(src, fmod.DeltaReader):  # (apply's own call on the reader it is given)
            return src
        here = threading.get_ident() == main
        opened.append((here, len(src)))
        if fails and not here:
            raise fmod.DeltaFormatError("injected: a parse off the calling thread")
        return real_open(src)
    monkeypatch.setattr(fmod.DeltaReader, "open", staticmethod(open_))
    held = {k: v.clone() for k, v in seq[0].items()}
    r = Follower(store, held, version=0, prefetch=4).sync()
    assert r.version == 2
    for k, v in seq[2].items():
        assert_bits_equal(held[k], v)
    off = [x for x in opened if not x[0]]
    assert len(off) == len(parts)  # every object parsed on a download thread
    if fails:
        assert [s.what for s in r.spans if s.stage == "parse"] == []
        assert sum(1 for x in opened if x[0]) == len(parts)  # ... and again by the step, each
    else:
        assert sorted(s.what for s in r.spans if s.stage == "parse") == sorted(parts)
        assert not any(x[0] for x in opened)  # the step parsed none itself


def test_a_delta_is_split_by_its_own_part_size(tmp_path):
    """A delta covers DELTA_PART_SCALE times the dense bytes of a keyframe's object (a delta is
    a small share of the bytes it covers; each object costs every receiver a request): here the
    keyframe is eight objects and each delta one. The hint each manifest carries names the next
    delta's objects, after a keyframe alone too, so a follower asks for exactly those beside
    HEAD. ``delta_part_bytes`` sets the delta's split of its own."""
    from nemo_dcr.sync.publisher import DELTA_PART_SCALE
    from nemo_dcr.sync.speculate import MAX_NAMES, predicted
    assert DELTA_PART_SCALE == 8
    g = torch.Generator().manual_seed(5)
    seq = [{f"t{i:02d}": torch.randn(2048, generator=g).bfloat16() for i in range(16)}]  # 4 KiB each
    for _ in range(2):
        s = {k: v.clone() for k, v in seq[-1].items()}
        for v in s.values():
            v[torch.randperm(2048, generator=g)[:40]] += 1
        seq.append(s)
    store = LocalStore(tmp_path / "s")
    pub = Publisher(store, part_bytes=8192)  # keyframe: two tensors an object; delta: 64 KiB, all
    res = [pub.publish(seq[0]), pub.publish(seq[1]), pub.publish(seq[2], keyframe=True)]
    m0, m1, m2 = (r.manifest for r in res)
    assert len(m0.keyframe_parts) == 8 and len(m1.parts) == 1
    assert len(m2.parts) == 1 and len(m2.keyframe_parts) == 8  # a keyframe beside a delta, each split its own way
    assert predicted(m0, MAX_NAMES) == [p.key for p in m1.parts]  # from the keyframe: the delta's one object
    assert predicted(m1, MAX_NAMES) == [p.key for p in m2.parts]
    held = {k: v.clone() for k, v in seq[0].items()}
    r = Follower(store, held, version=0, verify_initial=False).sync()
    assert r.version == 2
    assert sorted(s.what for s in r.spans if s.stage == "fetch") == [m1.parts[0].key, m2.parts[0].key]
    for k, v in seq[2].items():
        assert_bits_equal(held[k], v)
    # a delta split of its own: as the keyframe here
    split = Publisher(LocalStore(tmp_path / "t"), part_bytes=8192, delta_part_bytes=8192)
    ms = [split.publish(s).manifest for s in seq]
    assert len(ms[1].parts) == len(ms[2].parts) == 8
    assert predicted(ms[1], MAX_NAMES) == [p.key for p in ms[2].parts]


def _two_versions(tmp_path, seed: int, tensors: int, changed: int, every: int = 1):
    """A store holding version 0 (``tensors`` BF16 tensors of 1024 elements) and version 1
    (``changed`` elements moved in every ``every``-th tensor, the others as they were) ->
    (store, v0, v1, version 1's manifest)."""
    g = torch.Generator().manual_seed(seed)
    v0 = {f"t{i}": torch.randn(1024, generator=g).bfloat16() for i in range(tensors)}
    v1 = {k: v.clone() for k, v in v0.items()}
    for i, v in enumerate(v1.values()):
        if i % every == 0:
            v[torch.randperm(1024, generator=g)[:changed]] += 1
    store = LocalStore(tmp_path / "s")
    pub = Publisher(store, signer=None)
    pub.publish(v0)
    return store, v0, v1, pub.publish(v1).manifest


def _no_light_chunks(monkeypatch) -> None:
    """These tests' chunks are small, and so ``light`` (``codec/chunk.py``): written on the calling
    thread where nothing before them is out. Made heavy here: what is tested is the workers' stream,
    which chunks above that size take."""
    import nemo_dcr.codec.chunk as chunk_mod
    monkeypatch.setattr(chunk_mod, "LIGHT_DELTA", 0)
    monkeypatch.setattr(chunk_mod, "LIGHT_DENSE", 0)


def test_workers_go_on_to_later_chunks_while_one_is_held(tmp_path, monkeypatch):
    """A streamed object lists a tensor that did not change as an entry with no chunk of its own
    (its target digest alone), between the chunks of the others. Those entries go through the
    ordered stream too, and at ordered_map's window of two items a worker they left no chunk
    queued: with the first chunk held, the other worker wrote one more and then waited for it.
    The window is wider: the held chunk is let go only once four later ones are written (a
    GATE's wait, not a timing). (Such entries came from every chunk that filled a segment, the
    end of its tensor written in the next one; now only from tensors without a chunk.)"""
    import importlib
    apply_mod = importlib.import_module("nemo_dcr.delta.apply")
    monkeypatch.setattr(fmt, "SEGMENT_BYTES", 64)  # a segment for each chunk
    _no_light_chunks(monkeypatch)
    store, v0, v1, m = _two_versions(tmp_path, seed=9, tensors=16, changed=200, every=2)
    segs = list(fmt.SegmentStream(memoryview(store.get(m.parts[0].key))).ready(m.parts[0].size))
    entries = [e for r in segs for e in r.header.tensors]
    assert sum(1 for e in entries if e.chunks) >= 8 and any(not e.chunks for e in entries)

    real = apply_mod._apply_chunk
    first, later, lock = threading.Event(), threading.Event(), threading.Lock()
    done = []

    def gated(reader, t, c, *a, **k):
        if not first.is_set():
            first.set()
            assert later.wait(GATE), "no worker wrote four later chunks while the first was held"
            return real(reader, t, c, *a, **k)
        out = real(reader, t, c, *a, **k)
        with lock:
            done.append(c.start)
            if len(done) >= 4:
                later.set()
        return out
    monkeypatch.setattr(apply_mod, "_apply_chunk", gated)
    held = {k: v.clone() for k, v in v0.items()}
    r = Follower(store, held, version=0, verify_initial=False, stream=True, workers=2).sync()
    assert r.version == 1 and later.is_set()
    for k, v in v1.items():
        assert_bits_equal(held[k], v)


def test_a_sync_writes_on_one_more_worker_than_cores(tmp_path, monkeypatch):
    """A sync's chunks go to ``stream_workers`` (one more worker than cores, up to 8 cores) when
    the follower names no count: a worker waiting to take the GIL back between a chunk's steps
    leaves its core to the extra one. On a 2-core machine three chunks are written at once:
    each of the first three waits at a barrier of three (a GATE's wait, not a timing), which two
    workers never fill."""
    import importlib
    apply_mod = importlib.import_module("nemo_dcr.delta.apply")
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    _no_light_chunks(monkeypatch)
    store, v0, v1, _ = _two_versions(tmp_path, seed=11, tensors=6, changed=100)
    real = apply_mod._apply_chunk
    together = threading.Barrier(3, timeout=GATE)
    lock, seen = threading.Lock(), []

    def gated(reader, t, c, *a, **k):
        with lock:
            seen.append(c)
            first = len(seen) <= 3
        if first:
            together.wait()  # BrokenBarrierError (the sync fails) unless three workers are in here
        return real(reader, t, c, *a, **k)
    monkeypatch.setattr(apply_mod, "_apply_chunk", gated)
    held = {k: v.clone() for k, v in v0.items()}
    r = Follower(store, held, version=0, verify_initial=False, stream=True).sync()
    assert r.version == 1 and not together.broken and len(seen) == 6
    for k, v in v1.items():
        assert_bits_equal(held[k], v)


def test_later_syncs_reuse_their_threads(tmp_path):
    """The downloads and the parts streamed together run on standing threads
    (``util/parallel.standing``), reused from sync to sync: six more syncs start fewer threads
    than one sync has tasks (a sync that started its own, six here, waited for each on a busy
    machine before its first chunk). Not none: a thread that handed back its task's result may
    not count as idle yet when the next sync's first task comes, and then one more is started."""
    store = LocalStore(tmp_path / "s")
    seq = states(8)
    publish_all(store, seq, part_bytes=4096, delta_part_bytes=4096, keyframe_every=100)
    held = {k: v.clone() for k, v in seq[0].items()}
    f = Follower(store, held, version=0, stream=True)
    assert f.sync(1).version == 1
    started = []
    real_start = threading.Thread.start

    def start(self):
        started.append(self.name)
        real_start(self)

    threading.Thread.start = start
    try:
        rs = [f.sync(v) for v in range(2, 8)]
    finally:
        threading.Thread.start = real_start
    # three parts per version, each downloaded on a thread and applied on another as it arrives
    assert [len([s for s in r.spans if s.stage == "fetch"]) for r in rs] == [3] * 6
    assert len(started) < 2 * 3, started
    for k, v in seq[7].items():
        assert_bits_equal(held[k], v)


def test_publisher_encodes_the_next_part_while_one_uploads(tmp_path):
    """The first part's upload is held until the second part has been encoded (its upload
    started): without encode/upload overlap the gate's bounded wait runs out."""
    seq = states(2)
    store = GatedPutStore(tmp_path / "s", hold="/part-00000.dcr", until="/part-00000.1.dcr")
    pub = Publisher(store, part_bytes=4096, delta_part_bytes=4096)
    pub.publish(seq[0])
    r = pub.publish(seq[1])
    assert store.overlapped, "the second part was not encoded while the first uploaded"
    assert [s.what for s in r.spans if s.stage == "encode"] == ["delta part 0", "delta part 1", "delta part 2"]


@pytest.mark.parametrize("keyframe", [True, False])
def test_a_streamed_parts_buffer_goes_when_let_go_not_at_a_garbage_collection(tmp_path, keyframe):
    """A streaming follower's parts leave no reference cycles behind: the segment checker once kept
    a bound method of the object's stream, which held the download's buffer, so every part's bytes
    stayed until the next garbage collection (a streaming keyframe sync of 0.125 GiB peaked at
    1.64-1.72x the model instead of 1.27-1.35x)."""
    import gc
    store = LocalStore(tmp_path / "store")
    seq = states(2)
    publish_all(store, seq, part_bytes=4096, delta_part_bytes=4096, signer=None)
    held = {k: torch.zeros_like(v) if keyframe else v.clone() for k, v in seq[0].items()}
    at = {} if keyframe else {"version": 0, "verify_initial": False}
    f = Follower(store, held, stream=True, verifier=None, **at)
    gc.collect()
    gc.disable()
    try:
        gc.set_debug(gc.DEBUG_SAVEALL)
        res = f.sync()
        assert res.version == 1
        del f
        gc.collect()
        left = [type(o).__name__ for o in gc.garbage]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert not left, f"{len(left)} objects in reference cycles after a sync: {sorted(set(left))}"
    for k, v in seq[1].items():
        assert_bits_equal(held[k], v, k)
