"""Recovery by the receiver (issue 13 item 8; issue 10 defects 2 and 3, receiver side):

* a missing or corrupt object is worked around: the follower takes another path whose objects
  are all present and valid (the next keyframe with the deltas after it) and says which;
* a store wiped and republished under the same URL (same HEAD number, another history), or
  rewritten with a longer or shorter history, is noticed (manifest identity and state digest,
  not version numbers) and the receiver re-keys itself from the newest keyframe.

Real Publisher -> store (local directory, and the S3 server over HTTP) -> Follower on dict
tensors; the rollout loader's fast path is checked too."""
import pytest
import torch

from dcr_testing import assert_state, zeros_like
from nemo_dcr.errors import VersionNotFound
from nemo_dcr.integrations.rollout import RolloutLoader
from nemo_dcr.sync.follower import Follower
from nemo_dcr.sync.publisher import Publisher
from nemo_dcr.sync.versions import read_head, walk


def model(seed):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(48, 40, generator=g).bfloat16(), "b": torch.randn(40, generator=g),
            "e": torch.randn(20, 8, generator=g).half()}


def step(state, i):
    g = torch.Generator().manual_seed(100 + i)
    w = state["w"]
    w.view(torch.int16)[torch.rand(w.shape, generator=g) < 0.05] += 1
    state["b"][i % 40] += 0.25


def publish_versions(store, n, seed=0, keyframe_every=0):
    """Versions 0..n-1; -> list of each version's state (copies)."""
    state = model(seed)
    pub = Publisher(store, keyframe_every=keyframe_every)
    out = []
    for i in range(n):
        pub.publish(state)
        out.append({k: v.clone() for k, v in state.items()})
        step(state, i)
    return out


def manifest_of(store, version):
    return next(m for m in walk(store, read_head(store)[0]) if m.version == version)


def wipe(store):
    for k in store.list(""):
        store.delete(k)


# ----------------------------------------------------------------------------- lost objects

def test_lost_delta_part_is_worked_around_through_the_keyframe_of_that_version(store):
    states = publish_versions(store, 2, keyframe_every=2)  # v0 keyframe, v1 delta
    recv = zeros_like(states[0])
    f = Follower(store, recv, retries=0)
    f.sync()
    assert f.version == 1
    state = {k: v.clone() for k, v in states[1].items()}
    step(state, 7)
    pub = Publisher(store, keyframe_every=2)
    pub.publish(state)  # v2: delta + keyframe
    m2 = manifest_of(store, 2)
    assert m2.kind == "delta+keyframe"
    store.delete(m2.parts[0].key)  # v2's delta part is lost, its keyframe is there
    r = f.sync()
    assert r.steps == [("keyframe", 2)] and f.version == 2
    assert r.path == "keyframe 2"
    assert len(r.fallbacks) == 1 and r.fallbacks[0].startswith("delta 2: VersionNotFound")
    assert_state(recv, state)


def test_corrupt_newest_keyframe_part_does_not_block_fresh_pulls_or_publishing(store):
    states = publish_versions(store, 4, keyframe_every=2)  # keyframes at 0 and 2
    m2 = manifest_of(store, 2)
    key = m2.keyframe_parts[0].key
    store.put(key, store.get(key)[:-5])  # truncated: present, but not what the manifest says
    recv = zeros_like(states[0])
    r = Follower(store, recv, retries=0).sync()
    assert r.steps == [("keyframe", 0), ("delta", 1), ("delta", 2), ("delta", 3)]
    assert r.path == "keyframe 0 + deltas 1..3" and r.fallbacks[0].startswith("keyframe 2: CorruptObjectError")
    assert_state(recv, states[3])
    store.delete(key)  # and lost altogether: a restarted trainer still rebuilds its base and publishes
    state = {k: v.clone() for k, v in states[3].items()}
    step(state, 9)
    res = Publisher(store).publish(state)
    assert res.version == 4 and res.manifest.kind == "delta"
    late = zeros_like(state)
    assert Follower(store, late, retries=0).sync().path == "keyframe 0 + deltas 1..4"
    assert_state(late, state)


def test_no_path_left_names_the_object(store):
    states = publish_versions(store, 2)
    key = manifest_of(store, 1).parts[0].key
    store.delete(key)
    recv = zeros_like(states[0])
    with pytest.raises(VersionNotFound, match=key):
        Follower(store, recv, retries=0).sync()


# ----------------------------------------------------------------------------- other histories

def test_store_wiped_and_republished_with_the_same_head_number_is_noticed(store):
    a = publish_versions(store, 3, seed=1)
    recv = zeros_like(a[0])
    f = Follower(store, recv)
    f.sync()
    assert f.version == 2
    wipe(store)
    b = publish_versions(store, 3, seed=2)  # same URL, same HEAD number, other weights
    assert read_head(store)[0].version == 2
    assert not f.is_current(read_head(store)[0])
    r = f.sync()
    assert r.rekeyed and r.steps[0] == ("keyframe", 0) and f.version == 2
    assert_state(recv, b[2])
    f.check()
    assert f.sync().steps == []


def test_rollout_loader_notices_a_republished_store_with_the_same_head_number(tmp_path):
    from nemo_dcr.stores import LocalStore
    store = LocalStore(str(tmp_path / "s"))
    a = publish_versions(store, 2, seed=3)
    recv = zeros_like(a[0])
    loader = RolloutLoader(store, recv)
    assert loader.update() == 1
    wipe(store)
    b = publish_versions(store, 2, seed=4)
    assert loader.update() == 1
    assert loader.last_result.rekeyed
    assert_state(recv, b[1])


@pytest.mark.parametrize("newer", [5, 1], ids=["longer", "shorter"])
def test_store_republished_with_another_history_recovers_from_the_newest_keyframe(store, newer):
    a = publish_versions(store, 3, seed=5)
    recv = zeros_like(a[0])
    f = Follower(store, recv)
    f.sync()
    wipe(store)
    b = publish_versions(store, newer, seed=6, keyframe_every=2)
    r = f.sync()
    assert f.version == newer - 1 and r.rekeyed
    newest_kf = max(v for v in range(newer) if v % 2 == 0)
    assert r.steps[0] == ("keyframe", newest_kf)
    assert_state(recv, b[newer - 1])


def test_identical_republish_is_adopted_without_a_transfer(store):
    a = publish_versions(store, 2, seed=7)
    recv = zeros_like(a[0])
    f = Follower(store, recv)
    f.sync()
    old = f.manifest.key
    wipe(store)
    publish_versions(store, 2, seed=7)  # the same weights again (a deterministic rerun)
    r = f.sync()
    assert r.steps == [] and r.bytes == 0 and f.version == 1 and f.manifest.key != old
    assert_state(recv, a[1])
