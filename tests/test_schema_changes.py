"""Schema changes are first-class (issue 13, item 4): a version may add, remove, reshape, re-type
and rename tensors. State digests stay exact (a removed tensor leaves the digest, a reshaped or
re-typed one loses its old contribution), and receivers end with exactly the new tensor set,
bit-exact."""
from __future__ import annotations

import pytest
import torch

from dcr_testing import assert_state
from nemo_dcr import Follower, Publisher, apply, diff
from nemo_dcr.state.statedigest import ChangeDigest, state_contrib


def base_state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(8, 6, generator=g).to(torch.bfloat16),
        "w1": torch.randn(12, 5, generator=g),
        "w2": torch.randn(30, generator=g).to(torch.float16),
        "step": torch.tensor([7], dtype=torch.int64),
    }


def add(s):
    s["extra"] = torch.arange(5, dtype=torch.float32)


def remove(s):
    del s["w2"]


def reshape(s):
    s["w1"] = s["w1"].reshape(6, 10).clone()


def retype(s):
    s["embed"] = s["embed"].to(torch.float32)


def rename(s):
    s["renamed"] = s.pop("step")


def touch(s):
    s["w1"][0, :3] += 1.0


CHANGES = {"add": add, "remove": remove, "reshape": reshape, "retype": retype, "rename": rename}


def clone(s):
    return {k: v.clone() for k, v in s.items()}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_digest_change_of_diff_and_apply_is_exact(change):
    """Sender (diff) and receiver (apply) both move the state digest by exactly the change."""
    base = base_state()
    target = clone(base)
    CHANGES[change](target)
    touch(target)
    sent = ChangeDigest()
    blob = diff(base, target, on_change=sent, workers=1)
    assert state_contrib(base) + sent.total == state_contrib(target)
    recv = clone(base)
    got = ChangeDigest()
    apply(recv, blob, on_change=got, workers=1)
    assert_state(recv, target)
    assert got.total == sent.total


def test_apply_reports_every_element_of_a_removed_tensor_once():
    base = base_state()
    target = clone(base)
    remove(target)
    seen = []
    apply(clone(base), diff(base, target), on_change=lambda n, d, g, idx, old, new: seen.append((n, idx, old, new)))
    (name, idx, old, new), = [s for s in seen if s[0] == "w2"]
    assert new is None and sorted(idx.tolist()) == list(range(30))
    assert torch.equal(old, base["w2"].view(torch.int16))


def versions():
    """A chain of states, each one schema change (plus an ordinary update) after the last."""
    s = base_state()
    out = [clone(s)]
    for change in ("add", "remove", "reshape", "retype", "rename"):
        CHANGES[change](s)
        touch(s)
        out.append(clone(s))
    return out


def test_long_lived_publisher_and_follower_across_schema_changes(store):
    chain = versions()
    pub = Publisher(store, chunk_elems=16)
    recv = {}
    f = Follower(store, recv)
    for v, state in enumerate(chain):
        r = pub.publish(state)
        assert r.version == v
        # the manifest's digest is the state's, computed from scratch
        assert r.manifest.target_digest == state_contrib(state, definition=r.manifest.definition).hex()
        res = f.sync()
        assert f.version == v and res.steps[-1][1] == v
        assert_state(recv, state)
        f.check()  # O(model) recomputation agrees with the O(changes) bookkeeping
    late = {}
    Follower(store, late).sync()  # bootstraps from the keyframe at v0, then every delta
    assert_state(late, chain[-1])


def test_restarted_publisher_rebuilds_the_published_tensor_set(store):
    """A fresh Publisher (trainer restart) whose first snapshot adds and drops tensors: its base
    is the published state, not zeros shaped like the new snapshot."""
    chain = versions()
    Publisher(store).publish(chain[0])
    recv = {}
    f = Follower(store, recv)
    f.sync()
    for v, state in enumerate(chain[1:], start=1):
        r = Publisher(store).publish(state)  # no --keyframe: a delta against the rebuilt base
        assert r.version == v and r.manifest.parts, "published as a delta"
        assert r.manifest.target_digest == state_contrib(state, definition=r.manifest.definition).hex()
        f.sync()
        assert_state(recv, state)
        f.check()


def test_keyframe_removes_tensors_the_receiver_holds_that_the_target_lacks(store):
    chain = versions()
    pub = Publisher(store)
    pub.publish(chain[0])
    pub.publish(chain[2], keyframe=True)  # v1: adds "extra", drops "w2"
    recv = clone(chain[0])
    recv["stale"] = torch.ones(3)  # held by the receiver, named by no version
    f = Follower(store, recv)  # no version: bootstraps from the newest keyframe
    f.sync()
    assert f.version == 1
    assert_state(recv, chain[2])


def test_checkpoint_publish_and_pull_across_schema_changes(tmp_path):
    """The CLI's checkpoint path: each version's file pulled into one output file."""
    from safetensors.torch import load_file, save_file

    from nemo_dcr.checkpoint.sync import publish_checkpoint, pull_checkpoint, verify_checkpoint
    store = str(tmp_path / "store")
    out = str(tmp_path / "pulled.safetensors")
    for v, state in enumerate(versions()):
        src = str(tmp_path / f"v{v}.safetensors")
        save_file({k: t.contiguous() for k, t in state.items()}, src)
        publish_checkpoint(store, src)
        pull_checkpoint(store, out)
        assert_state(load_file(out), state)
        assert verify_checkpoint(store, out)[0] == v
