"""util/gc_pause: the cyclic collector held off while syncs, publishes, diffs and applies run, and
given back as it was once the last of them returns (docs/results.md, twenty-second turn)."""
from __future__ import annotations

import gc
import threading

import pytest
import torch

from nemo_dcr import apply, diff
from nemo_dcr.stores import LocalStore
from nemo_dcr.sync.follower import Follower
from nemo_dcr.sync.publisher import Publisher
from nemo_dcr.util.gc_pause import paused


@pytest.fixture(autouse=True)
def _collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def test_paused_holds_the_collector_off_until_the_last_call_returns():
    """Two calls overlapping from two threads: off from the first's start to the second's end."""
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def first():
        with paused():
            first_in.set()
            assert second_in.wait(30)
        first_out.set()

    t = threading.Thread(target=first)
    t.start()
    assert first_in.wait(30)
    seen["first running"] = gc.isenabled()
    with paused():
        second_in.set()
        assert first_out.wait(30)
        seen["first returned"] = gc.isenabled()
    t.join(30)
    seen["both returned"] = gc.isenabled()
    assert seen == {"first running": False, "first returned": False, "both returned": True}


def test_a_collector_disabled_before_stays_disabled_and_errors_pass_through():
    gc.disable()
    with pytest.raises(ValueError):
        with paused():
            raise ValueError("inside")
    assert not gc.isenabled()
    gc.enable()
    with pytest.raises(ValueError):
        with paused():
            raise ValueError("inside")
    assert gc.isenabled()


def test_env_leaves_the_collector_alone(monkeypatch):
    monkeypatch.setenv("NEMO_DCR_PAUSE_GC", "0")
    with paused():
        assert gc.isenabled()


class _Watching(LocalStore):
    """A local store noting the collector's state at each object read and written."""

    def __init__(self, root):
        super().__init__(root)
        self.states: list[bool] = []

    def get(self, key):
        self.states.append(gc.isenabled())
        return super().get(key)

    def open_writer(self, key):
        self.states.append(gc.isenabled())
        return super().open_writer(key)


def test_publish_sync_diff_and_apply_run_with_the_collector_off(tmp_path):
    g = torch.Generator().manual_seed(3)
    v0 = {f"w{i}": torch.randn(1000, generator=g).bfloat16() for i in range(3)}
    v1 = {k: (t.float() * 1.01).bfloat16() for k, t in v0.items()}
    store = _Watching(tmp_path / "s")
    pub = Publisher(store, signer=None)
    pub.publish(v0)
    pub.publish(v1)
    assert store.states and not any(store.states) and gc.isenabled()
    store.states.clear()
    held: dict = {}
    assert Follower(store, held).sync().version == 1
    assert store.states and not any(store.states) and gc.isenabled()
    assert all(torch.equal(held[k].view(torch.int16), v1[k].view(torch.int16)) for k in v1)

    inside = []

    def on_change(*_):
        inside.append(gc.isenabled())
    blob = diff(v0, v1, on_change=on_change)
    recv = {k: t.clone() for k, t in v0.items()}
    apply(recv, blob, on_change=on_change)
    assert inside and not any(inside) and gc.isenabled()
