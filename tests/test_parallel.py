"""util/parallel: the ordered map's order and window, and ``background`` beside it (outside the
window, inline where a wait could deadlock), as ``diff`` uses them for its whole-tensor digests;
``standing``, the threads a sync's downloads and streamed parts wait on; ``ordered_ahead``, jobs
run ahead of their consumer within a budget."""
from __future__ import annotations

import os
import sys
import threading

import pytest
import torch

from nemo_dcr import DcrError, diff
from nemo_dcr.util.parallel import (
    background,
    default_workers,
    in_jobs,
    ordered_ahead,
    ordered_map,
    standing,
    stream_workers,
)


def test_ordered_map_keeps_order_and_bounds_the_window():
    """Results in input order, and never more than ``window`` items taken ahead of what the
    caller has consumed (memory proportional to the window, not to the input)."""
    pulled, got, ahead = [0], [0], []

    def items():
        for x in range(100):
            pulled[0] += 1
            ahead.append(pulled[0] - got[0])
            yield x

    out = []
    for r in ordered_map(lambda x: x * x, items(), workers=2, window=3):
        out.append(r)
        got[0] += 1
    assert out == [x * x for x in range(100)]
    assert max(ahead) == 3  # the window is used, and not exceeded


def test_light_items_run_on_the_calling_thread_in_their_turn():
    """``light`` items, with nothing before them still out, run on the calling thread at once,
    in order, and an error is raised in its turn; a light item behind a job still running goes
    to a worker (here the job waits for it: kept back for the calling thread, it would never run)."""
    me, yielded, ran = threading.current_thread(), [0], {}

    def fn(x):
        ran[x] = (threading.current_thread() is me, yielded[0])
        if x == 7:
            raise ValueError("seven")
        return x * 10

    out = []
    with pytest.raises(ValueError, match="seven"):
        for r in ordered_map(fn, range(10), workers=2, window=4, light=lambda x: True):
            out.append(r)
            yielded[0] += 1
    assert out == [0, 10, 20, 30, 40, 50, 60]
    assert ran == {x: (True, x) for x in range(8)}  # each in its turn, nothing after the error

    go = threading.Event()

    def waits(x):
        if x == 0:
            assert go.wait(30), "the light item behind this job was not run meanwhile"
        else:
            go.set()
        return threading.current_thread() is me

    assert list(ordered_map(waits, range(2), workers=2, light=lambda x: x == 1)) == [False, False]


def test_background_runs_beside_the_ordered_stream():
    """A background job that can only finish once every item of the map is out: it must not
    hold the map's window (it would wait for itself) nor run before it."""
    mapped = threading.Event()

    def long_job():
        if not mapped.wait(timeout=30):
            raise AssertionError("the ordered map did not get past the background job")
        return "done"

    f = background(long_job, workers=2)
    assert list(ordered_map(lambda x: x + 1, range(50), workers=2)) == list(range(1, 51))
    mapped.set()
    assert f.result(timeout=30) == "done"


def test_background_runs_inline_in_a_pool_thread_and_hands_back_errors():
    def inner(x):
        f = background(lambda: threading.current_thread().name, workers=2)
        assert f.done()  # inline: a pool thread never waits on a job queued behind it
        bad = background(lambda: 1 // 0, workers=2)
        with pytest.raises(ZeroDivisionError):
            bad.result()
        return f.result()

    names = list(ordered_map(inner, range(4), workers=2))
    assert all(n.startswith("nemo-dcr") for n in names)
    with pytest.raises(ZeroDivisionError):
        background(lambda: 1 // 0, workers=2).result(timeout=30)


def test_diff_raises_what_its_digest_job_raised(monkeypatch):
    def broken(*a, **k):
        raise DcrError("digest failed")

    monkeypatch.setattr(sys.modules["nemo_dcr.delta.diff"], "tensor_digest", broken)
    a = torch.randn(5000).bfloat16()
    b = a.clone()
    b[::7] = b[::7] * 1.01
    with pytest.raises(DcrError, match="digest failed"):
        diff({"w": a}, {"w": b}, workers=2, chunk_elems=1024)


def _three_tensors(monkeypatch, seed: int, every: int):
    """Three one-chunk BF16 tensors, every ``every``-th element changed, and the delta one worker
    writes, with the clock fixed (the header's "created": the same bytes from any run)."""
    import time
    g = torch.Generator().manual_seed(seed)
    base = {n: torch.randn(3000, generator=g).bfloat16() for n in ("a", "b", "c")}
    target = {n: v.clone() for n, v in base.items()}
    for v in target.values():
        v[::every] = v[::every] * 1.01
    monkeypatch.setattr(time, "time", lambda: 1700000000.0)
    return base, target, diff(base, target, workers=1, chunk_elems=4096)


def test_diff_encodes_the_chunks_of_different_tensors_side_by_side(monkeypatch):
    """``diff``'s tensors share one stream over the workers: two tensors of one chunk each are
    encoded at once (the encodes wait for each other at a barrier, which a map per tensor, each
    ending with its one chunk, never reaches), and the delta is the one a single worker writes."""
    diff_mod = sys.modules["nemo_dcr.delta.diff"]
    base, target, alone = _three_tensors(monkeypatch, 3, 5)
    met = threading.Barrier(2, timeout=30)
    real = diff_mod.encode_chunk

    def encode(*a, **k):
        if threading.current_thread().name.startswith("nemo-dcr"):
            met.wait()  # BrokenBarrierError after 30 s if no other tensor's chunk is encoded meanwhile
        return real(*a, **k)

    monkeypatch.setattr(diff_mod, "encode_chunk", encode)
    # every chunk to the workers: a small chunk whose base digest is already done runs on the
    # calling thread (``_light``), and whether it is done first is a race (the definition-2
    # digests of format 5 made it one that the chunk lost at times, the barrier then waiting alone)
    light = diff_mod._light
    monkeypatch.setattr(diff_mod, "_light", lambda item: False)
    together = diff({"a": base["a"], "b": base["b"]}, {"a": target["a"], "b": target["b"]}, workers=2,
                    chunk_elems=4096)
    met.reset()
    monkeypatch.setattr(diff_mod, "_light", light)
    monkeypatch.setattr(diff_mod, "encode_chunk", real)
    assert diff(base, target, workers=2, chunk_elems=4096) == alone
    assert diff({"a": base["a"], "b": base["b"]}, {"a": target["a"], "b": target["b"]}, workers=1,
                chunk_elems=4096) == together


def test_small_chunks_are_encoded_and_applied_on_the_calling_thread(monkeypatch):
    """A delta's chunks of up to ``LIGHT_DELTA`` elements, with nothing before them still out,
    are encoded and applied on the calling thread (mostly Python: two threads only passed the GIL
    back and forth over them), larger ones on the workers; the delta and the applied state are
    the same either way."""
    from nemo_dcr import apply
    from nemo_dcr.codec.chunk import LIGHT_DELTA
    from nemo_dcr.codec.versions import FORMAT_VERSION, version
    from nemo_dcr.state.digest import Place, tensor_digest
    g = torch.Generator().manual_seed(5)
    sizes = {"s1": 3000, "s2": 5000, "t_big": LIGHT_DELTA + 4096}  # (name order: nothing out before s1, s2)
    base = {n: torch.randn(k, generator=g).bfloat16() for n, k in sizes.items()}
    target = {n: v.clone() for n, v in base.items()}
    for v in target.values():
        v[::50] = v[::50] * 1.01
    me = threading.current_thread()
    import time
    monkeypatch.setattr(time, "time", lambda: 1700000000.0)  # the header's "created": the same bytes

    def where(threads):
        def on_change(name, *rest):
            threads.setdefault(name, set()).add(threading.current_thread() is me)
        return on_change

    # the base's digests known (the publisher's snapshot): none is hashed beside the chunks
    algo = version(FORMAT_VERSION).tensor_digest  # the default version's
    known = {n: tensor_digest(v, algo, place=Place(n)) for n, v in base.items()}
    enc: dict = {}
    blob = diff(base, target, workers=2, on_change=where(enc), base_digests=known)
    assert blob == diff(base, target, workers=1)
    assert enc == {"t_big": {False}, "s1": {True}, "s2": {True}}
    held = {n: v.clone() for n, v in base.items()}
    dec: dict = {}
    apply(held, blob, workers=2, on_change=where(dec))
    assert dec == {"t_big": {False}, "s1": {True}, "s2": {True}}
    assert all(torch.equal(held[n].view(torch.int16), target[n].view(torch.int16)) for n in sizes)


def test_ordered_ahead_keeps_order_and_holds_jobs_within_the_budget():
    """Results in order; jobs out at once never more than ``most``, and their costs with the
    result the caller holds never over the budget, except one job alone; jobs do run side by side."""
    lock, out_now, seen, costs = threading.Lock(), {}, [], [3, 1, 1, 9, 2, 2, 2, 1, 5, 1]

    def job(i):
        with lock:  # started: it counts until the caller is done with its result
            out_now[i] = costs[i]
            seen.append(dict(out_now))
        return i

    got = []
    for i in ordered_ahead(job, range(len(costs)), costs.__getitem__, budget=6, most=3):
        got.append(i)
        with lock:
            del out_now[i]
    assert got == list(range(len(costs)))
    assert all(len(o) <= 3 and (sum(o.values()) <= 6 or len(o) == 1) for o in seen), seen
    assert max(len(o) for o in seen) == 3  # side by side (0, 1 and 2 start before 0 is handed out)


def test_ordered_ahead_hands_an_error_out_in_its_turn_and_leaves_nothing_running():
    """A job's error reaches the caller after the results before it; a caller that stops early
    returns only once every job started is done."""
    def job(i):
        if i == 2:
            raise ValueError("job 2")
        return i

    gen = ordered_ahead(job, range(6), lambda _: 1, budget=10, most=4)
    assert [next(gen), next(gen)] == [0, 1]
    with pytest.raises(ValueError, match="job 2"):
        next(gen)

    go, running = threading.Event(), []

    def waits(i):
        running.append(i)
        if i:
            assert go.wait(30)
        running.remove(i)
        return i

    gen = ordered_ahead(waits, range(4), lambda _: 1, budget=10, most=4)
    assert next(gen) == 0
    closer = threading.Thread(target=gen.close)
    closer.start()
    closer.join(0.5)
    assert closer.is_alive()  # jobs 1-3 are still running: close waits for them
    go.set()
    closer.join(30)
    assert not closer.is_alive() and running == []


def test_diff_hashes_a_one_range_tensors_base_beside_the_chunk_before_it(monkeypatch):
    """A delta's base digest of a tensor summed in one range runs on a worker while the chunk of
    the tensor before it is still being encoded (the two wait for each other at a barrier, which
    the calling thread, hashing one tensor after another, never reached), and the delta is the
    same bytes.

    The pair is a's chunk and b's digest, not b's and c's digests: the calling thread waits for
    b's digest when b's entry begins, and whether it had prepared c (and queued c's digest)
    before a finished chunk of b got it there is a race, which left b's digest at its barrier
    alone once. Every chunk goes to the workers (``_light`` off), so a's chunk is out while the
    stream prepares b."""
    diff_mod = sys.modules["nemo_dcr.delta.diff"]
    base, target, alone = _three_tensors(monkeypatch, 4, 7)
    met, real_digest, real_encode = threading.Barrier(2, timeout=30), diff_mod.tensor_digest, diff_mod.encode_chunk
    where = []

    def digest(t, *a, **k):
        if t is base["b"]:
            where.append(threading.current_thread().name)
            met.wait()  # BrokenBarrierError after 30 s if b's base is not hashed while a's chunk is out
        return real_digest(t, *a, **k)

    def encode(old, new, *a, **k):
        if new.data_ptr() == target["a"].data_ptr():
            met.wait()
        return real_encode(old, new, *a, **k)

    monkeypatch.setattr(diff_mod, "tensor_digest", digest)
    monkeypatch.setattr(diff_mod, "encode_chunk", encode)
    monkeypatch.setattr(diff_mod, "_light", lambda item: False)
    assert diff(base, target, workers=2, chunk_elems=4096) == alone
    assert len(where) == 1 and where[0].startswith("nemo-dcr")  # on a worker, not the calling thread


def _standing_threads() -> set:
    return {t.ident for t in threading.enumerate() if t.name.startswith("dcr-standing")}


def test_standing_runs_waiting_tasks_at_once_and_reuses_idle_threads():
    """Tasks that wait on each other all run at once (more of them than the cores: a pool sized
    to the cores would deadlock on the barrier), and a task submitted when a thread is idle runs
    on that thread: a sync's downloads no longer start threads each time."""
    n = 2 * (os.cpu_count() or 1) + 3
    barrier = threading.Barrier(n, timeout=30)
    futs = [standing(barrier.wait) for _ in range(n)]
    assert sorted(f.result(timeout=60) for f in futs) == list(range(n))  # every party got through
    before = _standing_threads()
    assert len(before) >= n
    ran = {standing(threading.get_ident).result(timeout=30) for _ in range(20)}  # one after the other
    assert ran <= before and _standing_threads() == before  # no thread started for them


def test_standing_hands_back_errors_and_its_threads_use_the_pools():
    """An error reaches ``result()``; an ``ordered_map`` called from a standing thread runs on
    the pools' threads (not inline, as it would from a pool thread), so a streamed part's chunks
    still go to the workers."""
    def boom():
        raise ValueError("from a standing thread")

    with pytest.raises(ValueError, match="from a standing thread"):
        standing(boom).result(timeout=30)

    def names():
        return list(ordered_map(lambda _: threading.current_thread().name, range(8), workers=2))

    assert all(n.startswith("nemo-dcr") for n in standing(names).result(timeout=30))


@pytest.mark.parametrize("cores,workers,stream", [(1, 1, 2), (2, 2, 3), (8, 8, 9), (16, 8, 8), (None, 1, 2)])
def test_stream_workers_add_one_where_the_pools_take_every_core(monkeypatch, cores, workers, stream):
    """``default_workers`` is the cores up to 8; ``stream_workers`` (an apply's chunks) one more
    where that is every core, and the same past 8 cores, where cores are left free already."""
    monkeypatch.setattr("os.cpu_count", lambda: cores)
    assert default_workers() == workers and stream_workers() == stream


def test_in_jobs_groups_consecutive_items_up_to_a_size():
    sizes = [3, 4, 2, 9, 1, 1, 12, 5]
    jobs = list(in_jobs(sizes, lambda n: n, 8))
    assert jobs == [[3, 4], [2], [9], [1, 1], [12], [5]]  # in order; a larger item a job of its own
    assert [x for j in jobs for x in j] == sizes
    assert list(in_jobs([], lambda n: n, 8)) == []
