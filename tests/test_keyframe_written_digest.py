"""A follower's keyframe sync checks the state digest from what its chunks wrote, summed as each
was written (``statedigest.WrittenDigest``), not by a pass over the model after the last chunk;
where what was summed is not all the receiver holds, or does not match, it sums the state whole."""
from __future__ import annotations

import pytest
import torch

from dcr_testing import assert_state
from nemo_dcr import ShardSpec
from nemo_dcr.state import statedigest
from nemo_dcr.state.statedigest import WrittenDigest, state_contrib
from nemo_dcr.stores import LocalStore
from nemo_dcr.sync import follower as follower_mod
from nemo_dcr.sync.follower import Follower
from nemo_dcr.sync.publisher import Publisher


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    odd = torch.tensor([float("nan"), -0.0, 1e-40, float("inf")], dtype=torch.float32)
    return {"w": torch.randn(300_000, generator=g).bfloat16(), "m": torch.randn(96, 80, generator=g).half(),
            "f": torch.cat([torch.randn(1000, generator=g), odd]), "i": torch.randint(-9, 9, (77, 5), generator=g),
            "empty": torch.zeros(0, 3)}


@pytest.fixture
def whole_passes(monkeypatch):
    """The tensors the follower sums whole (its ``state_contrib`` calls)."""
    calls: list = []
    real = follower_mod.state_contrib
    monkeypatch.setattr(follower_mod, "state_contrib", lambda t, *a, **kw: calls.append(sorted(t)) or real(t, *a, **kw))
    return calls


@pytest.mark.parametrize("stream", [False, True])
def test_a_keyframe_sync_sums_what_it_writes_and_no_pass_follows(tmp_path, whole_passes, stream):
    state = _state()
    store = LocalStore(tmp_path / "s")
    Publisher(store, chunk_elems=1 << 14).publish(state)
    recv: dict = {"w": torch.zeros_like(state["w"])}  # the rest are created by the keyframe
    res = Follower(store, recv, stream=stream).sync()
    assert_state(recv, state)
    assert res.version == 0 and whole_passes == []


def test_chunks_written_another_way_are_summed_whole(tmp_path, whole_passes):
    """A follower told of every write (``on_write``) writes each chunk through the general path,
    not into its range: nothing is summed as written, the state is summed whole, and matches."""
    state = _state(1)
    store = LocalStore(tmp_path / "s")
    Publisher(store, chunk_elems=1 << 12).publish(state)
    told: list = []
    recv = {k: torch.zeros_like(v) for k, v in state.items()}
    Follower(store, recv, on_write=lambda name, idx, bits: told.append(name)).sync()
    assert_state(recv, state)
    assert set(told) == {k for k, v in state.items() if v.numel()} and len(whole_passes) == 1


def test_what_was_summed_not_matching_is_summed_again_whole(tmp_path, whole_passes, monkeypatch):
    """A written sum that does not reach the manifest's digest (here: one chunk's share dropped,
    then one chunk summed with other bits) is not the verdict: the state is summed whole, and
    the sync, whose tensors do hold the target, succeeds."""
    state = _state(2)
    store = LocalStore(tmp_path / "s")
    Publisher(store, chunk_elems=1 << 14).publish(state)
    real_add = WrittenDigest.add
    for wrong in ("dropped", "other bits"):
        seen: list = []

        def add(self, name, dtype, region_map, bits, start, later=False, wrong=wrong, seen=seen):
            seen.append(name)
            if len(seen) == 2:
                if wrong == "dropped":
                    return
                bits = bits.clone()
                bits.view(-1)[0] = ~bits.view(-1)[0] if not bits.dtype.is_floating_point else bits.view(-1)[0] + 1
            real_add(self, name, dtype, region_map, bits, start, later)
        monkeypatch.setattr(WrittenDigest, "add", add)
        whole_passes.clear()
        recv = {k: torch.zeros_like(v) for k, v in state.items()}
        Follower(store, recv).sync()
        assert_state(recv, state)
        assert len(whole_passes) == 1, wrong


def test_the_written_sum_is_the_state_digest_of_a_keyframe_applied():
    """``WrittenDigest`` fed a state's regions in pieces is its state digest (and counts them)."""
    from nemo_dcr.state.index_map import IndexMap
    state = _state(3)
    w = WrittenDigest()
    for name, t in state.items():
        flat = t.reshape(-1)
        imap = IndexMap(ShardSpec.full(t.shape))
        for s in range(0, flat.numel(), 7000):
            w.add(name, t.dtype, imap, flat[s:s + 7000], s)
    assert w.complete and w.elements == sum(t.numel() for t in state.values())
    assert w.total == state_contrib(state) == statedigest.state_contrib(state)


def test_chunks_added_for_later_are_summed_at_the_end_and_others_as_added(monkeypatch):
    """A chunk added with ``later`` is summed when ``total`` is asked for (on the workers, with
    the others), one without as it is added; either way the total is the state digest, and a
    later chunk's share is of the bits its view holds at the end."""
    from nemo_dcr.state.index_map import IndexMap
    state = _state(4)
    g = torch.Generator().manual_seed(9)
    # a row block (one run of its tensor, from an offset) and a column block (a run a row)
    state["rows"], state["cols"] = torch.randn(40, 300, generator=g), torch.randn(100, 120, generator=g).half()
    shards = {"rows": ShardSpec.of((60, 300), (12, 0), (40, 300)),
              "cols": ShardSpec.of((100, 500), (0, 80), (100, 120))}
    want = state_contrib(state, shards)
    summed: list = []
    real, real_many = statedigest.region_contrib, statedigest.many_contrib
    monkeypatch.setattr(statedigest, "region_contrib",
                        lambda name, *a, **kw: summed.append(name) or real(name, *a, **kw))
    monkeypatch.setattr(statedigest, "many_contrib",  # the later chunks of one run of the canonical tensor
                        lambda ranges, **k: summed.extend(r[0] for r in ranges) or real_many(ranges, **k))
    w = WrittenDigest()
    added: list = []  # (name, elements, later) in the order added
    for name, t in state.items():
        flat, imap, s = t.reshape(-1), IndexMap(shards.get(name, ShardSpec.full(t.shape))), 0
        for size in (7000, 3000) * (flat.numel() // 10000 + 1):
            if s >= flat.numel():
                break
            w.add(name, t.dtype, imap, flat[s:s + size], s, later=size < 5000)
            added.append((name, min(size, flat.numel() - s), size < 5000))
            s += size
    now = [n for n, _, later in added if not later]
    assert summed == now and len(now) < len(added)  # nothing added for later summed yet
    assert w.total == want
    assert sorted(summed) == sorted(n for n, k, _ in added if k)  # every non-empty chunk once
    # a small chunk's view is read at the end: the state changed after ``add`` is what counts
    w2 = WrittenDigest()
    t = state["m"].clone()
    before = state_contrib({"m": t})
    w2.add("m", t.dtype, IndexMap(ShardSpec.full(t.shape)), t.reshape(-1), 0, later=True)
    t.view(torch.int16).view(-1)[0] ^= 1
    assert w2.total == state_contrib({"m": t}) != before
