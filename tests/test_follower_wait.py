"""``Follower.wait`` on stores that cannot long-poll reads HEAD once per ``poll_interval``,
whatever wraps them (issue 22: a signed store and a [relay that is down, store] list looked like
long-poll stores and were read in a busy loop: 26,312 and 142,538 HEAD reads in 3 s)."""
import socket

import pytest
import torch

from nemo_dcr.stores import FallbackStore, HttpStore, LocalStore
from nemo_dcr.sync.follower import Follower
from nemo_dcr.sync.publisher import Publisher
from nemo_dcr.sync.signing import Signer, Verifier, generate_key


class CountingStore(LocalStore):
    """A local store that counts reads of HEAD."""

    head_reads = 0

    def get_with_tag(self, key):
        if key == "HEAD":
            type(self).head_reads += 1
        return super().get_with_tag(key)


def closed_port() -> int:
    with socket.socket() as s:  # bound, then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("how", ["plain", "signed", "relay down, store"])
def test_wait_on_a_store_that_cannot_long_poll_reads_head_once_per_interval(tmp_path, how, monkeypatch):
    monkeypatch.setattr(CountingStore, "head_reads", 0)
    store = CountingStore(tmp_path / "store")
    key = generate_key()
    signer = Signer(key, "run-1") if how == "signed" else None
    Publisher(store, signer=signer).publish({"w": torch.arange(8.0)})
    verifier = Verifier([key.public_key()], "run-1") if how == "signed" else None
    source = store
    if how == "relay down, store":
        source = FallbackStore([HttpStore(f"http://127.0.0.1:{closed_port()}", timeout=1.0), store])
    f = Follower(source, {"w": torch.zeros(8)}, verifier=verifier)
    assert f.wait(newer_than=0, timeout=0.5, poll_interval=0.1) is None  # nothing newer comes
    # one read now and one per 0.1 s pause: 6 at most (before the fix: thousands)
    assert 2 <= CountingStore.head_reads <= 7
