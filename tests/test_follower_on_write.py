"""``Follower(on_write=)``: every chunk written is reported (deltas and keyframes), so a receiver that
keeps a tensor in a second layout (the vLLM receiver's pieces of a tensor held in several strided
boxes) can mirror each change, O(changes). A mirror built from the reports alone equals what the
follower holds, bit for bit; through a ``RolloutLoader`` the reports use the receiver's names."""
from __future__ import annotations

import threading

import torch

from nemo_dcr.integrations.rollout import RolloutLoader
from nemo_dcr.state.dtypes import int_view
from nemo_dcr.sync.follower import Follower
from nemo_dcr.sync.publisher import Publisher


def _states(n):
    g = torch.Generator().manual_seed(7)
    s = {"w": torch.randn(64, 48, generator=g).bfloat16(), "b": torch.randn(48, generator=g)}
    out = [s]
    for _ in range(n - 1):
        s = {k: v.clone() for k, v in s.items()}
        mask = torch.rand(s["w"].shape, generator=g) < 0.05
        s["w"] = torch.where(mask, s["w"] + 0.25, s["w"])
        s["b"][3] = float("nan")  # a NaN payload is a change like any other
        out.append(s)
    return out


class Mirror:
    def __init__(self, like: dict):
        self.bits = {k: int_view(torch.zeros_like(v)).reshape(-1).clone() for k, v in like.items()}
        self.names: set = set()
        self.lock = threading.Lock()

    def __call__(self, name, glob, new):
        with self.lock:  # from the apply's worker threads
            self.names.add(name)
            if new is not None:
                self.bits[name][glob] = new


def test_every_write_is_reported(tmp_path):
    states = _states(4)
    store = str(tmp_path / "store")
    pub = Publisher(store, keyframe_every=3, chunk_elems=512)
    held = {k: torch.zeros_like(v) for k, v in states[0].items()}
    mirror = Mirror(held)
    f = Follower(store, held, on_write=mirror)
    for v, s in enumerate(states):
        pub.publish(s)
        f.sync()
        assert f.version == v
        for k in held:
            assert torch.equal(mirror.bits[k], int_view(held[k]).reshape(-1)), (v, k)
    assert mirror.names == {"w", "b"}


def test_the_loader_reports_in_the_receiver_names(tmp_path):
    states = _states(2)
    store = str(tmp_path / "store")
    pub = Publisher(store)
    pub.publish(states[0])
    recv = {"W": torch.zeros_like(states[0]["w"]), "B": torch.zeros_like(states[0]["b"])}
    mirror = Mirror(recv)
    loader = RolloutLoader(store, recv, name_map={"w": "W", "b": "B"}, follower_options={"on_write": mirror})
    assert loader.update() == 0
    pub.publish(states[1])
    assert loader.update() == 1
    assert mirror.names == {"W", "B"}
    for k in recv:
        assert torch.equal(mirror.bits[k], int_view(recv[k]).reshape(-1)), k
