"""The host<->device byte counter the GPU script's O(changes) bounds rest on
(tests/dcr_testing/traffic.py): it must see copies made on worker threads (a receiver's apply
runs there), count both directions and every way of moving, and leave the tensor methods as they
were. ``meta`` stands in for a device (no data moves, the bytes are counted the same; nothing
copies out of it, so the way up is counted directly)."""
import threading

import pytest
import torch

from dcr_testing.traffic import Traffic


def test_counts_moves_on_every_thread_and_restores_the_methods():
    before = {n: torch.Tensor.__dict__.get(n) for n in ("to", "cpu", "cuda", "copy_")}
    on_meta = torch.empty(5, dtype=torch.float16, device="meta")
    with Traffic() as moved:
        torch.ones(10).to("meta")                          # 40 B down, on this thread
        t = threading.Thread(target=lambda: torch.ones(3, dtype=torch.int64).to(device="meta"))
        t.start()
        t.join()                                           # 24 B down, on another thread
        moved._count(on_meta, torch.empty(5, dtype=torch.float16))  # 10 B up (a meta tensor has no data to copy)
        torch.empty(7, dtype=torch.int16, device="meta").copy_(torch.zeros(7, dtype=torch.int16))  # 14 B down
        torch.ones(4).to(torch.float64)                    # host to host: nothing
    assert (moved.h2d, moved.d2h) == (40 + 24 + 14, 10)
    assert {n: torch.Tensor.__dict__.get(n) for n in before} == before
    with Traffic() as again:
        with pytest.raises(RuntimeError, match="do not nest"):
            Traffic().__enter__()
    assert (again.h2d, again.d2h) == (0, 0)
