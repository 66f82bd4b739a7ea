"""Publisher -> store -> Follower, single process, against both backends (a local directory and
a real S3 server over HTTP). Multi-rank publishing is in test_publish_multirank.py."""
import threading

import pytest
import torch

from dcr_testing import assert_state, zeros_like
from nemo_dcr import BaseMismatchError, PartialApplyError
from nemo_dcr.sync.follower import CorruptObjectError, Follower
from nemo_dcr.sync.publisher import Publisher
from nemo_dcr.sync.retention import prune
from nemo_dcr.sync.versions import CommitConflict, VersionNotFound, read_head, read_manifest


def model(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "layers.0.weight": torch.randn(64, 48, generator=g).bfloat16(),
        "layers.0.bias": torch.randn(48, generator=g),
        "emb": torch.randn(50, 16, generator=g).half(),
        "step": torch.tensor(0),
    }


def train_step(state, seed):
    """A sparse update like an optimizer step at a small learning rate."""
    g = torch.Generator().manual_seed(1000 + seed)
    w = state["layers.0.weight"]
    w.view(torch.int16)[torch.rand(w.shape, generator=g) < 0.03] += 1
    state["layers.0.bias"][seed % 48] += 0.5
    state["emb"].view(torch.int16)[seed % 50, :4] ^= 0x0101
    state["step"] += 1




def test_versions_flow_and_follower_tracks_every_one(store):
    state = model()
    pub = Publisher(store, keyframe_every=4)
    recv = zeros_like(state)
    f = Follower(store, recv)
    for i in range(6):
        r = pub.publish(state, step=i)
        assert r.version == i
        s = f.sync()
        assert s.steps == [("keyframe" if i == 0 else "delta", i)]
        assert f.version == i
        assert_state(recv, state)
        train_step(state, i)
    m = read_manifest(store, read_head(store)[0].manifest)
    assert m.version == 5 and m.base_version == 4 and m.parts and not m.keyframe_parts
    assert read_manifest(store, m.base_manifest).is_keyframe  # version 4 carries a keyframe too
    assert f.sync().steps == []  # nothing new


def test_publish_every_n_steps_sends_the_changes_of_n_steps(store):
    state = model(1)
    pub = Publisher(store)
    recv = zeros_like(state)
    f = Follower(store, recv)
    pub.publish(state, step=0)
    f.sync()
    base = {k: v.clone() for k, v in state.items()}
    for step in range(1, 4):  # three optimizer steps, one publish
        train_step(state, step)
    r = pub.publish(state, step=3)
    changed = sum(int((v.view(torch.int16 if v.element_size() == 2 else torch.int32 if v.element_size() == 4
                                  else torch.int64) != base[k].view(v.dtype).view(
        torch.int16 if v.element_size() == 2 else torch.int32 if v.element_size() == 4 else torch.int64)).sum())
        for k, v in state.items())
    assert r.changed == changed  # the delta spans steps 1..3 against the last published version
    assert r.manifest.base_version == 0 and r.manifest.step == 3
    assert f.sync().steps == [("delta", 1)]
    assert_state(recv, state)


def test_restarted_publisher_continues_the_chain(store):
    state = model(2)
    Publisher(store).publish(state)
    train_step(state, 1)
    r = Publisher(store).publish(state)  # a new process would rebuild its base from the store
    assert r.version == 1 and r.manifest.parts and r.delta_bytes < r.keyframe_bytes + 1 + r.delta_bytes
    recv = zeros_like(state)
    assert Follower(store, recv).sync().steps == [("keyframe", 0), ("delta", 1)]
    assert_state(recv, state)


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "delete"])
def test_damaged_object_is_named_receiver_unchanged_then_recovers(store, damage):
    state = model(3)
    pub = Publisher(store)
    pub.publish(state)
    recv = zeros_like(state)
    f = Follower(store, recv, retries=1, backoff=0.0)
    f.sync()
    train_step(state, 0)
    m = pub.publish(state).manifest
    key = m.parts[0].key
    good = store.get(key)
    if damage == "corrupt":
        bad = bytearray(good)
        bad[len(bad) // 2] ^= 0xFF
        store.put(key, bytes(bad))
    elif damage == "truncate":
        store.put(key, good[: len(good) // 3])
    else:
        store.delete(key)
    before = {k: v.clone() for k, v in recv.items()}
    with pytest.raises((CorruptObjectError, VersionNotFound)) as ei:
        f.sync()
    assert key in str(ei.value)
    assert_state(recv, before)
    assert f.version == 0
    store.put(key, good)
    assert f.sync().steps == [("delta", 1)]
    assert_state(recv, state)


def interrupted_follower(store, monkeypatch, seed, fail_at, error):
    """A follower at version 0 whose sync to version 1 is interrupted (fault injection: decoding
    chunk number ``fail_at`` raises ``error``) after earlier chunks were written in place.
    -> (trainer state at version 1, receiver tensors, follower)."""
    import importlib
    delta_mod = importlib.import_module("nemo_dcr.delta.apply")  # the module, not the function

    state = model(seed)
    pub = Publisher(store, chunk_elems=256)
    pub.publish(state)
    recv = zeros_like(state)
    f = Follower(store, recv)
    f.sync()
    train_step(state, 0)
    pub.publish(state)
    real = delta_mod.decode_chunk
    calls = {"n": 0}

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == fail_at:
            raise error
        return real(*a, **k)

    monkeypatch.setattr(delta_mod, "decode_chunk", flaky)
    with pytest.raises(type(error)):
        f.sync()
    monkeypatch.setattr(delta_mod, "decode_chunk", real)
    return state, recv, f


def test_follower_interrupted_mid_apply_repairs_on_next_sync(store, monkeypatch):
    """Decoding the 3rd chunk raises, after two chunks were written in place."""
    state, recv, f = interrupted_follower(store, monkeypatch, 4, 3,
                                          OSError("connection reset while streaming (injected)"))
    assert f.version is None  # it knows it is in between
    r = f.sync()
    assert r.repaired and f.version == 1
    assert_state(recv, state)


def test_tampered_receiver_is_rebootstrapped_from_a_keyframe(store, monkeypatch):
    state, recv, f = interrupted_follower(store, monkeypatch, 5, 2, RuntimeError("injected"))
    recv["emb"][0, 0] = 123.0  # and something else scribbles on the weights meanwhile
    r = f.sync()
    assert r.repaired and ("keyframe", 0) in r.steps and f.version == 1
    assert_state(recv, state)


def test_wrong_base_is_refused(store):
    state = model(6)
    pub = Publisher(store)
    pub.publish(state)
    wrong = {k: v.clone() for k, v in state.items()}
    wrong["layers.0.bias"][0] = -wrong["layers.0.bias"][0]
    with pytest.raises(BaseMismatchError):
        Follower(store, wrong, version=0)
    recv = {k: v.clone() for k, v in state.items()}
    f = Follower(store, recv, version=0)  # the right base is accepted
    f.check()
    train_step(state, 0)
    pub.publish(state)
    # a scribble where the next delta writes: the chunk's pre-image check refuses it
    recv["layers.0.bias"][0] += 1
    with pytest.raises((BaseMismatchError, PartialApplyError), match="does not match its base"):
        f.sync()
    assert f.version is None  # never labelled version 1
    assert f.sync().steps == [("keyframe", 0), ("delta", 1)]
    assert_state(recv, state)
    # a scribble where no delta writes: only a whole-state check can see it
    recv["layers.0.bias"][7] += 1
    with pytest.raises(BaseMismatchError):
        f.check()
    assert f.version is None
    f.sync()
    assert_state(recv, state)


def test_two_publishers_race_exactly_one_wins(store):
    a, b = model(7), model(8)
    Publisher(store).publish(a)
    pa, pb = Publisher(store), Publisher(store)
    pa.publish(a)  # both know version 1 as their base
    pb._restore(read_head(store)[0], b, {})
    train_step(a, 1)
    barrier = threading.Barrier(2)
    results = {}

    def go(name, pub, st):
        barrier.wait()
        try:
            results[name] = pub.publish(st)
        except CommitConflict as e:
            results[name] = e

    b2 = {k: v.clone() for k, v in a.items()}
    b2["step"] += 100
    ts = [threading.Thread(target=go, args=("a", pa, a)), threading.Thread(target=go, args=("b", pb, b2))]
    [t.start() for t in ts]
    [t.join() for t in ts]
    wins = [n for n, r in results.items() if not isinstance(r, Exception)]
    losses = [n for n, r in results.items() if isinstance(r, CommitConflict)]
    assert len(wins) == 1 and len(losses) == 1, results
    winner = {"a": a, "b": b2}[wins[0]]
    recv = zeros_like(a)
    Follower(store, recv).sync()
    assert_state(recv, winner)
    assert read_head(store)[0].version == 2


def test_late_joiner_after_retention(store):
    state = model(9)
    pub = Publisher(store, keyframe_every=3, retain=1)
    early = zeros_like(state)
    fe = Follower(store, early)
    for i in range(8):
        pub.publish(state)
        if i == 1:
            fe.sync()
        train_step(state, i)
    pub.publish(state)  # version 8
    head = read_head(store)[0]
    assert head.keyframe_version == 6
    versions = {int(k.split("/")[1]) for k in store.list("versions/")}
    assert min(versions) == 6 and max(versions) == 8  # older versions were deleted
    late = zeros_like(state)
    r = Follower(store, late).sync()
    assert r.steps == [("keyframe", 6), ("delta", 7), ("delta", 8)]
    assert_state(late, state)
    r = fe.sync()  # fell behind past the retention window: bootstraps from the keyframe
    assert r.steps[0] == ("keyframe", 6)
    assert_state(early, state)
    assert prune(store, head, keep=1) == []  # nothing more to delete
