"""Format version 3 (issue 25): segments with each chunk's index before the chunk, tensor
digests summed over elements and updated from the changes alone. Versions 1 and 2 stay as they
were (tests/test_golden.py); a reader that knows only versions 1 and 2 refuses version 3 with the
error it gives any version it does not know."""
import importlib
from unittest import mock

import pytest
import torch

from dcr_testing import assert_state
from nemo_dcr import DeltaReader, apply, diff
from nemo_dcr.codec import format as fmt
from nemo_dcr.errors import DeltaFormatError, PartialApplyError, TargetMismatchError
from nemo_dcr.state import digest as digest_mod
from nemo_dcr.state.digest import tensor_digest

diff_module = importlib.import_module("nemo_dcr.delta.diff")  # the module (nemo_dcr.delta.diff is the function)


def states(seed=0, n=300_000):
    g = torch.Generator().manual_seed(seed)
    base = {"w": torch.randn(n, generator=g).bfloat16(), "b": torch.randn(257, generator=g),
            "ids": torch.randint(0, 1 << 40, (33, 3), generator=g), "gone": torch.ones(5)}
    target = {k: v.clone() for k, v in base.items() if k != "gone"}
    target["w"].view(-1)[::97] = torch.randn(target["w"].numel() // 97 + 1, generator=g).to(torch.bfloat16)
    target["b"][5] = -0.0
    target["new"] = torch.arange(10)
    return base, target


def test_version_3_round_trips_and_its_digests_are_the_sums_of_the_tensors():
    base, target = states()
    blob = diff(base, target, format_version=3, chunk_elems=1 << 16)
    r = DeltaReader.open(blob)
    assert r.version == 3 and r.header.format == 3
    for t in r.header.tensors:
        if t.target_digest:
            assert t.target_digest == tensor_digest(target[t.name], "sd"), t.name
        if t.base_digest:
            assert t.base_digest == tensor_digest(base[t.name], "sd"), t.name
    recv = {k: v.clone() for k, v in base.items()}
    apply(recv, blob)  # verify=True: every tensor digest checked (the "sd" sum, from the tensor alone)
    assert_state(recv, target)


@pytest.mark.parametrize("fv", [3, 4, 5])
def test_a_verified_apply_reads_each_tensor_once_the_target_follows_from_the_changes(monkeypatch, fv):
    """``apply(verify=True)``: each base digest is the sum over the held tensor (read once); the
    target's is that sum moved by the changes written (before: each tensor was hashed a second
    time after its chunks, O(model) again: 228 ms against 138 ms for 64M BF16 at 1 %). Raw bits
    of every kind, sparse chunks and dense ones (a tensor changed whole)."""
    import sys

    from nemo_dcr.state import statedigest
    apply_mod = sys.modules["nemo_dcr.delta.apply"]  # (the package's ``apply`` is the function)
    g = torch.Generator().manual_seed(7)
    odd = torch.tensor([float("nan"), -0.0, 1e-40, float("inf"), -float("inf"), 0.0], dtype=torch.float32)
    base = {"w": torch.randn(200_000, generator=g).bfloat16(), "h": torch.randn(4099, generator=g).half(),
            "f": torch.cat([torch.randn(1000, generator=g), odd]), "i": torch.randint(-9, 9, (77, 5), generator=g),
            "all": torch.randn(5000, generator=g)}
    target = {k: v.clone() for k, v in base.items()}
    target["w"].view(-1)[::53] = torch.randn(200_000 // 53 + 1, generator=g).bfloat16()
    target["h"][::7] = -target["h"][::7]
    target["f"].view(torch.int32)[-6:] = torch.tensor([0x7FC01234, -(1 << 31), 1, 0x7F800000, -8388608, 5],
                                                      dtype=torch.int32)  # a NaN payload, -0.0, ...
    target["i"][3] = 0
    target["all"] += 1.0  # every element: dense chunks
    blob = diff(base, target, format_version=fv, chunk_elems=1 << 14)
    hashed, running = [], []
    real = statedigest.tensor_contrib
    monkeypatch.setattr(statedigest, "tensor_contrib", lambda *a, **kw: hashed.append(a[0]) or real(*a, **kw))
    real_running = apply_mod.RunningDigest
    monkeypatch.setattr(apply_mod, "RunningDigest", lambda *a, **kw: running.append(a) or real_running(*a, **kw))
    recv = {k: v.clone() for k, v in base.items()}
    report = apply(recv, blob)
    assert_state(recv, target)
    assert report.tensors_changed == len(target) and not report.unverified
    assert len(hashed) == len(target) and running == []  # the base checks only

    def flip(h):  # a target digest that the changes do not reach
        e = next(t for t in h["tensors"] if t["name"] == "all")
        e["target_digest"] = e["target_digest"][:-1] + ("0" if e["target_digest"][-1] != "0" else "1")
    import copy

    from dcr_testing.deltas import rewrite
    h = copy.deepcopy(DeltaReader(blob).raw_header)
    flip(h)
    recv = {k: v.clone() for k, v in base.items()}
    with pytest.raises(PartialApplyError) as e:
        apply(recv, rewrite(blob, h))
    assert isinstance(e.value.__cause__, TargetMismatchError) and "all" in str(e.value.__cause__)


@pytest.mark.parametrize("fv, algo", [(3, "sd"), (4, "sdn"), (5, "sdb")])
def test_a_keyframe_beside_a_delta_takes_the_digests_the_delta_reached(monkeypatch, tmp_path, fv, algo):
    """A version published with a delta and a keyframe: the delta sums each tensor's digest from
    the changes, and the keyframe's entries carry those, their chunks not summed again (a
    keyframe chunk's sum was 1.6 of its ~10 ms of CPU). The digests are the definition's, and a
    verified apply of the keyframe checks them."""

    from nemo_dcr.state.digest import Place, SumKey
    from nemo_dcr.stores import LocalStore
    from nemo_dcr.sync.publisher import Publisher
    base, target = states(4, 100_000)
    store = LocalStore(tmp_path / "store")
    pub = Publisher(store, chunk_elems=1 << 14, format_version=fv)
    pub.publish(base)
    summed = []
    real = SumKey.range
    monkeypatch.setattr(SumKey, "range", lambda self, bits, *a: summed.append(bits) or real(self, bits, *a))
    ahead = diff_module.many_contrib  # a small tensor sent whole: summed ahead, on a worker
    monkeypatch.setattr(diff_module, "many_contrib",
                        lambda ranges, **k: summed.extend(r[3] for r in ranges) or ahead(ranges, **k))
    r = pub.publish(target, keyframe=True)
    monkeypatch.undo()
    m = r.manifest
    assert m.parts and m.keyframe_parts
    for p in m.keyframe_parts:
        blob = store.get(p.key)
        for e in DeltaReader.open(blob).header.tensors:
            assert e.target_digest == tensor_digest(target[e.name], algo, place=Place(e.name)), e.name
        recv: dict = {}
        apply(recv, blob)  # verify=True: the target digests checked against the tensors made
        assert_state(recv, {k: target[k] for k in recv})
    # only "new", created by the delta itself (a tensor sent whole there), was summed
    assert {a.numel() for a in summed} == {target["new"].numel()}, [a.numel() for a in summed]


def test_a_reader_of_versions_1_and_2_refuses_version_3_clearly():
    base, target = states(1, 1000)
    blob = diff(base, target, format_version=3)
    with mock.patch.dict(fmt.VERSIONS, {k: v for k, v in fmt.VERSIONS.items() if k < 3}, clear=True):
        with pytest.raises(DeltaFormatError, match="format version 3 is not supported"):
            DeltaReader.open(blob)


def test_diff_of_a_known_base_hashes_no_tensor_whole(monkeypatch):
    """The target digests come from the base's and the changes: no tensor is read whole to
    hash it (before: every changed tensor was hashed, O(model) per version)."""
    import sys
    diff_mod = sys.modules["nemo_dcr.delta.diff"]  # (the package's ``diff`` is the function)
    from nemo_dcr.state import statedigest
    base, target = states(2)
    first = DeltaReader.open(diff({}, base, format_version=3)).header
    known = {t.name: t.target_digest for t in first.tensors}
    hashed = []
    for mod, fn in ((diff_mod, "tensor_digest"), (statedigest, "tensor_contrib"), (digest_mod, "RunningDigest")):
        real = getattr(mod, fn)
        monkeypatch.setattr(mod, fn, lambda *a, _real=real, **kw: hashed.append(a[0]) or _real(*a, **kw))
    diff(base, target, format_version=2, base_digests={})  # (the check sees a tensor hashed whole)
    assert hashed
    hashed.clear()
    blob = diff(base, target, format_version=3, base_digests=known)
    assert hashed == []
    monkeypatch.undo()
    h = DeltaReader.open(blob).header
    assert {t.name: t.target_digest for t in h.tensors if t.target_digest} == \
        {k: tensor_digest(v, "sd") for k, v in target.items()}


def test_indexes_come_before_their_chunks_in_segments_of_bounded_size(monkeypatch):
    monkeypatch.setattr(fmt, "SEGMENT_BYTES", 4096 // fmt.KEYFRAME_SEGMENT_SCALE)  # a keyframe's: 4096
    base, target = states(3)
    blob = diff({}, target, format_version=3, chunk_elems=1 << 12)  # a keyframe: 600 KB of payloads
    pos, seen, kinds = fmt.PREAMBLE.size, 0, []
    while pos < len(blob) - fmt.TRAILER.size:
        index, start, pos = fmt.read_segment(blob, pos, len(blob) - fmt.TRAILER.size, AssertionError)
        kinds.append(next(iter(index)))
        assert pos - start <= 4096 + 2 * (1 << 12) * 2  # a segment: its limit and one more chunk
        seen += sum(len(p["chunks"]) for p in index.get("tensors", []))
    assert kinds[0] == "open" and kinds[-1] == "close" and len(kinds) > 10
    assert seen == sum(len(t.chunks) for t in DeltaReader.open(blob).header.tensors)


def _segment_sizes(blob: bytes) -> list:
    """The bytes of each segment of ``blob`` that holds tensors (its index and payloads)."""
    pos, out = fmt.PREAMBLE.size, []
    while pos < len(blob) - fmt.TRAILER.size:
        index, start, pos = fmt.read_segment(blob, pos, len(blob) - fmt.TRAILER.size, AssertionError)
        if "tensors" in index:
            out.append(pos - start)
    return out


def test_a_keyframes_segments_gather_more_than_a_deltas(monkeypatch):
    """A keyframe (every tensor sent whole) gathers KEYFRAME_SEGMENT_SCALE times a delta's
    segment bytes: a model of small tensors was a segment per tensor, each with an index to make
    and parse. The keyframe applies to the same state either way."""
    g = torch.Generator().manual_seed(8)
    state = {f"layers.{i:03d}.weight": torch.randn(16384, generator=g).bfloat16() for i in range(64)}
    blob = diff({}, state, format_version=3)
    sizes = _segment_sizes(blob)
    limit = fmt.SEGMENT_BYTES * fmt.KEYFRAME_SEGMENT_SCALE
    assert all(n <= limit + 2 * 16384 * 2 for n in sizes) and len(sizes) <= -(-sum(sizes) // limit) + 1
    monkeypatch.setattr(fmt, "KEYFRAME_SEGMENT_SCALE", 1)
    small = diff({}, state, format_version=3)
    assert len(_segment_sizes(small)) >= 16 * len(sizes)
    for b in (blob, small):
        recv: dict = {}
        apply(recv, b)
        assert_state(recv, state)


def test_a_tensor_ends_in_the_segment_its_last_chunk_fills(monkeypatch):
    """A segment that a chunk fills is closed at its tensor's next chunk or at its end, whichever
    comes first: a tensor whose last chunk fills it ends in it, and a tensor that goes on past it
    continues in the next segment with that next chunk. Before, it was closed at once, and every
    such tensor left a piece without chunks in the next segment, for its target digest alone,
    which a receiver parsed, planned and started as a piece of its own (half the pieces of a 1 %
    delta of one-chunk tensors)."""
    monkeypatch.setattr(fmt, "SEGMENT_BYTES", 64)  # each chunk fills a segment
    g = torch.Generator().manual_seed(12)
    base = {f"t{i}": torch.randn(4096, generator=g).bfloat16() for i in range(6)}
    base["long"] = torch.randn(4 * 4096, generator=g).bfloat16()  # four chunks: it goes on past three segments
    base["same"] = torch.randn(100, generator=g).bfloat16()       # unchanged: an entry without chunks
    target = {k: v.clone() for k, v in base.items()}
    for k, v in target.items():
        if k != "same":
            v[torch.randperm(v.numel(), generator=g)[:300]] += 1
    blob = diff(base, target, format_version=5, chunk_elems=4096)
    pieces = [(p["name"], len(p["chunks"]), p["last"]) for index in _segments(blob) for p in index.get("tensors", [])]
    assert [q for q in pieces if q[0] != "same" and not q[1]] == []  # no piece without a chunk but the unchanged one's
    assert [q for q in pieces if q[0] == "long"] == [("long", 1, False)] * 3 + [("long", 1, True)]
    assert all(q == (f"t{i}", 1, True) for i, q in enumerate(q for q in pieces if q[0].startswith("t")))
    recv = {k: v.clone() for k, v in base.items()}
    apply(recv, blob)
    assert_state(recv, target)
    from nemo_dcr.delta import apply_stream
    held = {k: v.clone() for k, v in base.items()}  # and as it arrives: a segment at a time
    report = apply_stream(held, fmt.SegmentStream(memoryview(blob)).ready(len(blob)))
    assert report.chunks_applied == 10
    assert_state(held, target)


def test_a_segment_full_of_pieces_ends_with_whole_tensors():
    """A segment closed by its piece count (many small tensors: SEGMENT_PIECES) ends after a
    tensor's last piece; before, that tensor's chunks were written again as a piece of the next
    segment, and the reader refused the delta ("again after its last piece")."""
    state = {f"layers.{i:05d}.bias": torch.full((3,), float(i)) for i in range(fmt.SEGMENT_PIECES + 500)}
    blob = diff({}, state, format_version=3, workers=1)
    r = DeltaReader.open(blob)
    assert len(r.header.tensors) == len(state) and all(len(t.chunks) == 1 for t in r.header.tensors)
    recv: dict = {}
    apply(recv, blob)
    assert_state(recv, state)


@pytest.mark.parametrize("known", [False, True])
def test_a_tensor_in_several_segments_without_a_known_base_digest(monkeypatch, known):
    """A delta whose base digests are not known beforehand (the CLI's diff of two checkpoints, a
    restarted publisher's first delta): a tensor's first piece names its base digest, as its
    last does. Before, the first piece went out without it while the digest was hashed beside the
    chunks, and the reader refused the delta ("ends without its last piece")."""
    monkeypatch.setattr(fmt, "SEGMENT_BYTES", 2048)
    base, target = states(6)
    known_digests = {k: tensor_digest(v, "sd") for k, v in base.items()} if known else None
    blob = diff(base, target, format_version=3, chunk_elems=1 << 12, base_digests=known_digests)
    r = DeltaReader.open(blob)
    pieces = [p for index in _segments(blob) for p in index.get("tensors", []) if p["name"] == "w"]
    assert len(pieces) > 3 and r.header.entry("w").base_digest == tensor_digest(base["w"], "sd")
    recv = {k: v.clone() for k, v in base.items()}
    apply(recv, blob)
    assert_state(recv, target)


def _segments(blob):
    pos = fmt.PREAMBLE.size
    while pos < len(blob) - fmt.TRAILER.size:
        index, _, pos = fmt.read_segment(blob, pos, len(blob) - fmt.TRAILER.size, AssertionError)
        yield index


def test_every_truncation_and_every_flipped_index_byte_is_a_format_error():
    base, target = states(4, 3000)
    blob = diff(base, target, format_version=3, chunk_elems=512)
    for n in range(0, len(blob), 7):
        with pytest.raises(DeltaFormatError):
            DeltaReader.open(blob[:n])
    pos = fmt.PREAMBLE.size
    while pos < len(blob) - fmt.TRAILER.size:  # each segment's header and index, byte by byte
        _, start, nxt = fmt.read_segment(blob, pos, len(blob) - fmt.TRAILER.size, AssertionError)
        for i in range(pos, start):
            bad = bytearray(blob)
            bad[i] ^= 0x10
            with pytest.raises(DeltaFormatError):
                DeltaReader.open(bytes(bad))
        pos = nxt


def test_pieces_of_a_tensor_across_segments_must_agree(monkeypatch):
    """A tensor spans segments as pieces; pieces that disagree, or a tensor without its last
    piece, are refused."""
    base, target = states(5)
    blob = diff(base, target, format_version=3, chunk_elems=1 << 12)
    m = fmt.SegmentMerger(lambda why: (_ for _ in ()).throw(DeltaFormatError(why)))
    m.add({"open": {"format": 3}}, 0, 0)
    m.add({"tensors": [{"name": "w", "kind": "delta", "dtype": "bfloat16", "shape": [4], "chunks": [],
                        "last": False}]}, 100, 0)
    with pytest.raises(DeltaFormatError, match="ends without its last piece"):
        m.add({"tensors": [{"name": "x", "kind": "delta", "dtype": "bfloat16", "shape": [4], "chunks": [],
                            "last": True}]}, 200, 0)
    with pytest.raises(DeltaFormatError, match="closing segment"):
        m.add({"close": {"tensors": 0}}, 300, 0)
    assert DeltaReader.open(blob).header.entry("w").chunks  # (the real one parses)


# ----------------------------------------------------------------------------- HEAD carries the manifest

class CountingStore:
    """Every read of a store, by key (a LocalStore underneath; its get_with_tag is a get)."""

    def __new__(cls, root):
        from nemo_dcr.stores import LocalStore

        class Counting(LocalStore):
            def __init__(self, *a, **kw):
                super().__init__(*a, **kw)
                self.reads: list = []

            def get(self, key):
                self.reads.append(key)
                return super().get(key)

            def get_stream(self, key, offset=0):
                self.reads.append(key)
                return super().get_stream(key, offset)
        return Counting(root)


@pytest.mark.parametrize("signed", [False, True])
def test_a_follower_of_format_3_reads_head_then_the_parts(tmp_path, signed):
    """One round trip before the parts: HEAD carries the manifest it names (before: HEAD, then
    the manifest, then the parts)."""
    from dcr_testing import zeros_like
    from nemo_dcr.sync.follower import Follower
    from nemo_dcr.sync.publisher import Publisher
    from nemo_dcr.sync.signing import Signer, Verifier, generate_key
    from nemo_dcr.sync.versions import is_manifest_key, read_head
    key = generate_key()
    store = CountingStore(tmp_path / "store")
    base, target = states(6, 20_000)
    base.pop("gone")
    pub = Publisher(store, format_version=3, signer=Signer(key, "run-1") if signed else None)
    pub.publish(base)
    recv = zeros_like(base)
    f = Follower(store, recv, verifier=Verifier([key.public_key()], "run-1") if signed else None)
    f.sync()
    assert_state(recv, base)
    pub.publish(target)
    head = read_head(store)[0]
    assert head.format == 4 and head.newest_manifest.version == 1 and head.newest_manifest.parts
    store.reads.clear()
    r = f.sync()
    assert r.steps == [("delta", 1)]
    assert_state(recv, target)
    assert store.reads[0] == "HEAD" and not any(is_manifest_key(k) for k in store.reads), store.reads
    assert all(k.endswith(".dcr") for k in store.reads[1:]), store.reads


def test_a_damaged_or_swapped_manifest_in_head_is_refused(tmp_path):
    import json

    from nemo_dcr.errors import ManifestError
    from nemo_dcr.stores import LocalStore
    from nemo_dcr.sync.publisher import Publisher
    from nemo_dcr.sync.versions import HEAD_KEY, Head, canonical_sha256, read_head
    store = LocalStore(tmp_path / "store")
    base, target = states(7, 2000)
    pub = Publisher(store, format_version=3, signer=None, object_checksum="sha256")  # HEAD and manifests: format 3
    first = pub.publish(base).manifest
    pub.publish(target)
    d = json.loads(store.get(HEAD_KEY))
    d["newest"] = json.loads(first.to_bytes())  # another version's manifest, HEAD resealed
    d.pop("checksum")
    d["checksum"] = canonical_sha256(d)
    with pytest.raises(ManifestError, match="names itself|not the manifest"):
        Head.from_bytes(json.dumps(d).encode())
    good = json.loads(store.get(HEAD_KEY))
    good["newest"]["step"] = 7  # an edit inside the carried manifest, HEAD resealed
    good.pop("checksum")
    good["checksum"] = canonical_sha256(good)
    with pytest.raises(ManifestError, match="checksum"):
        Head.from_bytes(json.dumps(good).encode())
    with mock.patch("nemo_dcr.sync.versions._READABLE", (1, 2)):  # a reader of formats 1 and 2
        with pytest.raises(ManifestError, match="HEAD format 3 is not supported"):
            read_head(store)


def _held_store(root, suffix: str, share: float, wrote, why: str):
    """A local store that, once ``hold`` is set, serves the first ``share`` of each object whose
    key ends with ``suffix`` and the rest only once ``wrote`` is set (the receiver wrote
    something); ``held``: the keys so held."""
    from nemo_dcr.stores import LocalStore

    class Held(LocalStore):
        hold = False
        held: list = []

        def get_stream(self, key, offset=0):
            size, chunks = super().get_stream(key, offset)
            if not (self.hold and key.endswith(suffix)):
                return size, chunks
            data = b"".join(chunks)
            cut = int(len(data) * share)

            def gen():
                self.held.append(key)
                if cut:
                    yield data[:cut]
                assert wrote.wait(30), why
                yield data[cut:]
            return size, gen()
    return Held(root)


def test_a_streaming_follower_applies_a_format_3_object_while_it_arrives(tmp_path, monkeypatch):
    """``stream=True``: the segments of one part are applied as they arrive, before the object's
    last bytes are there (the store holds the end back until the first write happened)."""
    import threading

    from dcr_testing import zeros_like
    from nemo_dcr.sync.follower import Follower
    from nemo_dcr.sync.publisher import Publisher
    monkeypatch.setattr(fmt, "SEGMENT_BYTES", 1024)
    base, target = states(8, 400_000)
    base.pop("gone")
    wrote = threading.Event()
    store = _held_store(tmp_path / "store", ".dcr", 3 / 4, wrote, "nothing was applied before the object's end arrived")
    pub = Publisher(store, format_version=3, signer=None, chunk_elems=4096)
    pub.publish(base)
    recv = zeros_like(base)
    f = Follower(store, recv, verifier=None, stream=True, on_write=lambda name, idx, new: wrote.set())
    f.sync()
    pub.publish(target)
    wrote.clear()
    store.hold = True
    r = f.sync()
    assert wrote.is_set() and r.steps == [("delta", 1)] and f.version == 1
    assert_state(recv, target)


def test_a_streaming_follower_applies_the_parts_downloading_at_once_together(tmp_path):
    """A delta in several parts, downloading at once: a later part is applied as it arrives while
    the first one is still on its way (the store holds part 0 back until something was written,
    which only another part can do). Taken one at a time in the plan's order, the sync waited
    for part 0 and the write never came."""
    import threading

    from dcr_testing import zeros_like
    from nemo_dcr.sync.follower import Follower
    from nemo_dcr.sync.publisher import Publisher
    g = torch.Generator().manual_seed(21)
    base = {f"w{i}": torch.randn(40_000, generator=g).bfloat16() for i in range(4)}
    target = {k: v.clone() for k, v in base.items()}
    for v in target.values():
        v.view(-1)[::53] = torch.randn(v.numel() // 53 + 1, generator=g).to(torch.bfloat16)
    wrote = threading.Event()
    store = _held_store(tmp_path / "store", "/part-00000.dcr", 0, wrote,
                        "no other part was applied while the first one was held back")
    pub = Publisher(store, signer=None, part_bytes=80_000, delta_part_bytes=80_000)  # one 40K BF16 tensor a part
    pub.publish(base)
    r1 = pub.publish(target)
    assert len(r1.manifest.parts) == 4
    recv = zeros_like(base)
    f = Follower(store, recv, verifier=None, stream=True, on_write=lambda name, idx, new: wrote.set())
    f.sync(0)
    wrote.clear()
    store.hold = True
    r = f.sync()
    assert store.held and r.steps == [("delta", 1)] and f.version == 1
    assert_state(recv, target)


def test_the_later_steps_of_a_path_stream_their_parts_too(tmp_path, monkeypatch):
    """A sync over two deltas (version 0 -> 1 -> 2), each in eight parts, twice what the follower
    downloads at once: every part of both steps is applied as it arrives. The first step ending
    stops what waits for its own parts' downloads, not the next step's (whose last parts start
    downloading only once its first ones are taken)."""
    from dcr_testing import zeros_like
    from nemo_dcr.stores import LocalStore
    from nemo_dcr.sync.follower import Follower
    from nemo_dcr.sync.publisher import Publisher
    g = torch.Generator().manual_seed(22)
    seq = [{f"w{i}": torch.randn(40_000, generator=g).bfloat16() for i in range(8)}]
    for _ in range(2):
        nxt = {k: v.clone() for k, v in seq[-1].items()}
        for v in nxt.values():
            v.view(-1)[::61] = torch.randn(v.numel() // 61 + 1, generator=g).to(torch.bfloat16)
        seq.append(nxt)
    store = LocalStore(tmp_path / "store")
    pub = Publisher(store, signer=None, part_bytes=80_000, delta_part_bytes=80_000)
    keys = [[p.key for p in pub.publish(s).manifest.parts] for s in seq]
    assert len(keys[1]) == len(keys[2]) == 8
    streamed: list = []
    real = Follower._apply_arriving

    def arriving(self, p, *a, **kw):
        streamed.append(p.key)
        return real(self, p, *a, **kw)
    monkeypatch.setattr(Follower, "_apply_arriving", arriving)
    recv = zeros_like(seq[0])
    f = Follower(store, recv, verifier=None, stream=True, prefetch=4)
    f.sync(0)
    streamed.clear()
    r = f.sync()
    assert r.steps == [("delta", 1), ("delta", 2)] and f.version == 2
    assert sorted(streamed) == sorted(keys[1] + keys[2])
    assert_state(recv, seq[2])


def _stream_case(monkeypatch, seed=9):
    monkeypatch.setattr(fmt, "SEGMENT_BYTES", 256)  # ~5 chunks of w's 49 a segment
    base, target = states(seed, 200_000)
    base.pop("gone")
    blob = diff(base, target, format_version=3, chunk_elems=1 << 12)
    return base, target, blob


@pytest.mark.parametrize("workers", [1, 3])
def test_apply_stream_writes_each_segment_as_it_comes_and_ends_where_apply_does(monkeypatch, workers):
    """``apply_stream``: the segments of an arriving object, all their chunks in one stream over
    the workers (issue 25: one ``apply`` per segment made each segment a barrier). The segments
    are handed over one at a time: the chunks of the first ones are written before the later
    ones are read, and the receiver ends at the target, as ``apply`` of the whole object."""
    import threading

    from nemo_dcr.delta import apply_stream
    from nemo_dcr.state.statedigest import ChangeDigest, state_contrib
    base, target, blob = _stream_case(monkeypatch)
    readers = list(fmt.SegmentStream(memoryview(blob)).ready(len(blob)))
    assert len(readers) > 10
    recv = {k: v.clone() for k, v in base.items()}
    wrote = threading.Event()
    change = ChangeDigest()

    def on_change(*a):
        change(*a)
        wrote.set()

    def segments():
        yield readers[0]
        assert wrote.wait(30), "the first segment was not written before the next one was asked for"
        yield from readers[1:]

    journal: set = set()
    rep = apply_stream(recv, segments(), workers=workers, journal=journal, on_change=on_change)
    assert_state(recv, target)
    whole = {k: v.clone() for k, v in base.items()}
    ref = apply(whole, blob, verify=False)
    assert (rep.chunks_applied, rep.elements_changed) == (ref.chunks_applied, ref.elements_changed)
    assert rep.tensors_added == ["new"] and len(journal) == ref.chunks_applied
    assert state_contrib(base) + change.total == state_contrib(target)


def test_apply_stream_raises_a_damaged_segment_as_is_after_the_ones_before_it(monkeypatch):
    """A segment whose chunk fails its checksum is refused before its first write, as a
    ``DeltaFormatError`` (what a follower takes as bytes damaged on the way: it applies the whole
    object once checked), once every segment before it is written; their chunks are in the
    journal, so applying the whole object afterwards skips them and ends at the target."""
    from nemo_dcr.delta import ApplyReport, apply_stream
    base, target, blob = _stream_case(monkeypatch)
    readers = list(fmt.SegmentStream(memoryview(blob)).ready(len(blob)))
    bad = 4
    c = readers[bad].header.tensors[0].chunks[0]
    damaged = bytearray(blob)
    damaged[c.off] ^= 0xFF
    readers = list(fmt.SegmentStream(memoryview(bytes(damaged))).ready(len(blob)))
    recv = {k: v.clone() for k, v in base.items()}
    journal: set = set()
    rep = ApplyReport()
    with pytest.raises(DeltaFormatError, match="checksum"):
        apply_stream(recv, iter(readers), workers=2, journal=journal, report=rep)
    before = {(t.name, ch.start) for r in readers[:bad] for t in r.header.tensors for ch in t.chunks}
    assert journal == before and rep.chunks_applied == len(before)
    apply(recv, blob, resume=True, journal=journal)  # the whole object, checked, verified
    assert_state(recv, target)


def test_apply_stream_on_a_wrong_base_is_a_partial_apply_once_something_was_written(monkeypatch):
    """A chunk whose pre-image differs, after other chunks were written: ``PartialApplyError``
    (the receiver changed), as ``apply`` says it."""
    from nemo_dcr.delta import apply_stream
    from nemo_dcr.errors import BaseMismatchError
    base, target, blob = _stream_case(monkeypatch)
    readers = list(fmt.SegmentStream(memoryview(blob)).ready(len(blob)))
    recv = {k: v.clone() for k, v in base.items()}
    last = (base["w"].numel() - 1) // 97 * 97  # the last change (states: every 97th element)
    recv["w"].view(torch.int16)[last] ^= 1  # the base differs there only: in the last chunk
    with pytest.raises(PartialApplyError, match="does not match its base") as e:
        apply_stream(recv, iter(readers), workers=2, journal=set())
    assert isinstance(e.value.__cause__, BaseMismatchError)


def test_a_stream_finished_checks_what_opening_the_object_checks_beyond_its_segments(monkeypatch):
    """``SegmentStream.finish``: once every segment was taken, the closing segment and the
    trailer, without parsing the object a second time -> its tensor names, as the whole header
    has them. A damaged trailer or a stream cut short is a ``DeltaFormatError``."""
    base, target, blob = _stream_case(monkeypatch)
    s = fmt.SegmentStream(memoryview(blob))
    assert len(list(s.ready(len(blob)))) > 10
    assert s.finish() == DeltaReader.open(blob).header.names == sorted(target)
    for at, what in ((len(blob) - 1, "end marker"), (len(blob) - fmt.TRAILER.size + 4, "segments")):
        bad = bytearray(blob)
        bad[at] ^= 0xFF
        s = fmt.SegmentStream(memoryview(bytes(bad)))
        list(s.ready(len(bad)))
        with pytest.raises(DeltaFormatError, match=what):
            s.finish()
    s = fmt.SegmentStream(memoryview(blob))
    next(iter(s.ready(len(blob))))  # one segment taken, the rest not
    with pytest.raises(DeltaFormatError, match="no closing segment"):
        s.finish()


def test_a_stream_waits_for_whole_segments_not_for_each_read(monkeypatch):
    """``SegmentStream.wanted``: with some bytes there, how many must be before ``ready`` can give
    the next segment: its header first, then its index and payloads; once the closing segment is
    read, more than the object (what comes then is the end of the download)."""
    base, target, blob = _stream_case(monkeypatch)
    s = fmt.SegmentStream(memoryview(blob))
    filled, got = 0, 0
    while True:
        want = s.wanted(filled)
        if want > len(blob):
            break
        assert filled < want <= len(blob)
        assert not list(s.ready(want - 1))  # one byte short: nothing new
        filled = want
        got += len(list(s.ready(filled)))
    assert got == len(list(fmt.SegmentStream(memoryview(blob)).ready(len(blob)))) and s.finish()


def test_a_keyframe_is_cut_in_chunks_of_at_most_keyframe_chunk_a_delta_in_chunk_elems(tmp_path):
    """Deltas use ``chunk_elems`` (``DEFAULT_CHUNK``, 4Mi: each chunk's fixed work is a third of a
    1Mi chunk's cost); a keyframe's dense chunks at most ``KEYFRAME_CHUNK`` (1Mi), so that the
    chunks in flight of a keyframe publish or sync hold 1Mi-element copies, not 4Mi."""
    from nemo_dcr.codec.names import DEFAULT_CHUNK, KEYFRAME_CHUNK
    from nemo_dcr.stores import LocalStore
    from nemo_dcr.sync.publisher import Publisher
    g = torch.Generator().manual_seed(11)
    base = {"w": torch.randn(DEFAULT_CHUNK + 5, generator=g).bfloat16()}
    target = {"w": base["w"].clone()}
    target["w"][::101] = torch.randn(target["w"][::101].numel(), generator=g).bfloat16()
    store = LocalStore(tmp_path / "store")
    pub = Publisher(store, keyframe_every=1, signer=None)
    pub.publish(base)
    m = pub.publish(target).manifest
    delta = DeltaReader.open(store.get(m.parts[0].key)).header
    key = DeltaReader.open(store.get(m.keyframe_parts[0].key)).header
    assert delta.chunk_elems == DEFAULT_CHUNK and delta.tensors[0].chunks[0].n == DEFAULT_CHUNK
    assert key.chunk_elems == KEYFRAME_CHUNK == 1 << 20
    assert len(key.tensors[0].chunks) == DEFAULT_CHUNK // KEYFRAME_CHUNK + 1
