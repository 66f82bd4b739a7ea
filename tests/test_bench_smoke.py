"""Smoke test of the codec benchmark: bench/codec.py --quick --json runs and reports sane numbers."""
import contextlib
import io
import json
import math
import statistics
import subprocess
import sys

import pytest

from dcr_testing import bench
from nemo_dcr.codec.versions import FORMAT_VERSION

ENCODINGS = ("overwrite", "xor", "add", "classes", "auto")
ENTROPY = ("positions", "positions_given_exponent", "positions_given_exponent_prev", "values", "values_add",
           "values_add_given_exponent", "sign", "sign_given_prev")
PREV = ("positions_given_exponent_prev", "sign_given_prev")


def _load_codec():
    return bench.load("codec")


@pytest.fixture(scope="module")
def result():
    codec = _load_codec()
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = codec.main(["--quick", "--json"])
    assert rc == 0, err.getvalue()
    return json.loads(out.getvalue())


def _le(a, b, what):
    assert a <= b + 1e-9 * max(1.0, abs(b)), what


def test_shape(result):
    c = result["config"]
    assert c["quick"] and c["steps"] >= 4 and len(c["lrs"]) >= 1
    assert c["every"] == [1, 4]
    assert set(c["encodings"]) == set(ENCODINGS)
    assert {"overwrite", "xor", "add", "auto"} <= set(c["encodings_measured"]) <= set(ENCODINGS)
    assert len(result["pairs"]) == sum(c["steps"] // e for e in c["every"]) * len(c["lrs"])
    assert {p["every"] for p in result["pairs"]} == {1, 4}
    assert result["machine"]["cpus"] >= 1
    assert isinstance(result["notes"], list)
    s = result["summary"]
    assert {"every=1", "every=4"} <= set(s)
    for lr in c["lrs"]:
        for e in c["every"]:
            assert f"lr={lr:g} every={e}" in s
    for k, v in s.items():
        assert set(v["bytes_per_changed"]) == set(ENCODINGS), k
        assert set(v["order0_bytes_per_changed"]) == set(ENTROPY), k
        assert all(x is not None for x in v["order0_bytes_per_changed"].values()), k
        assert set(v["sign_bits_per_changed"]) == {"order0", "given_prev"}, k
        assert {"diff", "apply", "chunk_encode", "chunk_decode"} <= set(v["x_memcpy_median"]), k


def test_series(result):
    """Every lr: every-1 pairs 0->1->2->..., every-4 pairs 0->4->8...; the |prev yardsticks only
    from a series' second pair on."""
    for lr in result["config"]["lrs"]:
        for e in result["config"]["every"]:
            ps = [p for p in result["pairs"] if p["lr"] == lr and p["every"] == e]
            assert [(p["step_from"], p["step_to"]) for p in ps] == [(i * e, (i + 1) * e) for i in range(len(ps))]
            for i, p in enumerate(ps):
                assert p["series_index"] == i + 1
                for k in PREV:
                    assert (p["order0_bytes"][k] is None) == (i == 0), (lr, e, i, k)
                assert (p["sign_bits_per_changed"]["given_prev"] is None) == (i == 0)


def test_pairs_sane(result):
    measured = set(result["config"]["encodings_measured"])
    for p in result["pairs"]:
        what = f"lr {p['lr']} every {p['every']} pair {p['step_from']}->{p['step_to']}"
        assert p["every"] in (1, 4), what
        assert p["apply_verified"] is True, what
        assert p["dense_bytes"] == 2 * p["elements"], what  # BF16
        assert 0 < p["changed"] <= p["elements"], what
        assert math.isclose(p["change_rate"], p["changed"] / p["elements"]), what
        b, pay = p["bytes"], p["payload_bytes"]
        for key in ("bytes", "payload_bytes", "header_bytes", "bytes_per_changed"):
            assert set(p[key]) == set(ENCODINGS), (what, key)
        for e in ENCODINGS:
            assert (b[e] is None) == (e not in measured), (what, e)
        for e in measured:
            assert math.isclose(p["bytes_per_changed"][e], b[e] / p["changed"]), (what, e)
            assert b[e] == pay[e] + p["header_bytes"][e], (what, e)  # the streams add up
        # mixed picks per chunk among the encodings (classes first, the rest when classes is
        # not cheap enough): never much worse than the best single encoding
        assert b["auto"] <= min(b[e] for e in measured) * 1.05 + 256, what
        assert b["auto"] == pay["auto"] + p["mixed_streams"]["header"], what
        assert math.isclose(p["ratio_dense_to_mixed"], p["dense_bytes"] / b["auto"]), what
        assert p["ratio_dense_to_mixed"] > 1, what
        for k in ("memcpy", "diff", "apply"):
            assert p["time_s"][k] > 0 and p["gbps"][k] > 0, what
        assert p["x_memcpy"]["diff"] > 0 and p["x_memcpy"]["apply"] > 0, what
        for k in ("chunk_encode", "chunk_decode"):  # null while the kernel is missing or fails
            assert p["x_memcpy"][k] is None or p["x_memcpy"][k] > 0, what
            assert (p["time_s"][k] is None) == (p["x_memcpy"][k] is None), what
        assert p["chunk_kernel"]["encoding"] == "classes", what
        if "classes" in measured:
            assert p["chunk_kernel"]["error"] is None, (what, p["chunk_kernel"])
            assert p["x_memcpy"]["chunk_encode"] and p["x_memcpy"]["chunk_decode"], what
        # entropy yardsticks: all keys, per changed element, and conditioning never adds bits
        o, ob = p["order0_bytes_per_changed"], p["order0_bytes"]
        assert set(o) == set(ob) == set(ENTROPY), what
        for k in ENTROPY:
            if ob[k] is not None:
                assert ob[k] >= 0 and math.isclose(o[k], ob[k] / p["changed"]), (what, k)
        _le(o["positions_given_exponent"], o["positions"], what)
        _le(o["values_add_given_exponent"], o["values_add"], what)
        sg = p["sign_bits_per_changed"]
        assert math.isclose(sg["order0"], 8 * o["sign"]) and sg["order0"] <= 1 + 1e-9, what
        if o["positions_given_exponent_prev"] is not None:
            _le(o["positions_given_exponent_prev"], o["positions_given_exponent"], what)
            _le(sg["given_prev"], sg["order0"], what)


def test_entropy_bounds_by_hand():
    """Changes only at one exponent, all the same +1 ulp, then the same again: every
    conditioned yardstick is zero."""
    codec = _load_codec()
    import torch
    a = {"w": torch.tensor([1.0] * 4 + [2.0] * 4, dtype=torch.bfloat16)}
    step = torch.tensor([1] * 4 + [0] * 4, dtype=torch.int16)
    up = lambda t: (t.view(torch.int16) + step).view(torch.bfloat16)  # noqa: E731
    b = {"w": up(a["w"])}
    c = {"w": up(b["w"])}
    dirs = {}
    r1 = codec.entropy_bounds(a, b, None, dirs)
    assert dirs["w"].tolist() == [1] * 4 + [0] * 4
    assert math.isclose(r1["positions"], 1.0)  # 8 elements, half changed: 8 bits
    assert r1["positions_given_exponent"] == 0 and r1["values_add"] == 0 and r1["values_add_given_exponent"] == 0
    assert r1["sign"] == 0 and r1["positions_given_exponent_prev"] is None and r1["sign_given_prev"] is None
    r2 = codec.entropy_bounds(b, c, dirs)
    assert r2["positions_given_exponent_prev"] == 0 and r2["sign_given_prev"] == 0


def test_encoding_missing_is_skipped(monkeypatch):
    """A nemo_dcr without the classes encoding: its column is null / n/a, with a note."""
    codec = _load_codec()
    monkeypatch.setattr(codec.chunk, "CHOICES", tuple(e for e in codec.chunk.CHOICES if e != "classes"))
    res = codec.run(steps=1, lrs=[1e-5], warmup_steps=0, workers=1, reps=1, quick=True, every=(1,))
    assert "classes" not in res["config"]["encodings_measured"]
    assert any("'classes' skipped" in n for n in res["notes"])
    (p,) = res["pairs"]
    assert p["bytes"]["classes"] is None and p["bytes_per_changed"]["classes"] is None
    assert p["bytes"]["auto"] > 0
    assert res["summary"]["every=1"]["bytes_per_changed"]["classes"] is None
    text = codec.format_tables(res)
    assert "B/chg classes" in text and "skipped" in text


def test_bit_exact_check_fails_loudly():
    codec = _load_codec()
    import torch
    a = {"w": torch.zeros(4, dtype=torch.bfloat16)}
    b = {"w": torch.tensor([0.0, -0.0, 0.0, 0.0], dtype=torch.bfloat16)}  # equal as floats, not as bits
    with pytest.raises(codec.BenchError, match="NOT BIT-EXACT"):
        codec.check_equal(a, b, "test")


def test_shard_budget_bench_runs_and_checks_bits():
    """bench/shard.py on one untiled copy of a barely warmed-up model: every ratio is measured
    against the same process's memcpy, and the decodes were checked bit for bit (it raises
    otherwise)."""
    shard = bench.load("shard")
    r = shard.run(lr=1e-6, copies=1, reps=1, warmup_steps=2, cache_dir=None, workers=2)
    assert r["elements"] > 6_000_000 and 0 < r["change_rate"] < 0.5
    assert set(r["x_memcpy"]) == set(r["seconds"]) and r["x_memcpy"]["memcpy_1thread"] == 1.0
    assert all(v > 0 for v in r["seconds"].values())
    assert "classes" in r["chunk_encodings"] and r["delta_bytes_per_changed"] < 2.0
    assert "| diff |" in shard.format_table(r)


def _load_kernels():
    return bench.load("kernels")


def _run_json(mod, argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert mod.main(argv) == 0
    return json.loads(out.getvalue())


def test_reload_bench_quick_over_the_rate_limiter():
    """bench/reload.py --quick (smaller still): the S3 server behind the in-process rate limiter,
    dense and delta reloads checked bit for bit inside (it raises otherwise), every column."""
    pytest.importorskip("moto.moto_server.werkzeug_app")
    res = _run_json(bench.load("reload"), ["--quick", "--json", "--sizes", "300000", "--shaping", "proxy",
                                           "--format-version", "2",  # (the fan-out bench runs the default, 3)
                                           "--reps", "2",
                                           "--chunk-elems", "4096"])  # (each ~18K-element matrix in 5 chunks)
    assert res["config"]["shaping"].startswith("in-process rate limiter") and res["config"]["format_version"] == 2
    assert res["config"]["chunk_elems"] == 4096
    assert {r["via"] for r in res["rows"]} == {"s3", "relay"}
    for r in res["rows"]:
        assert r["changes"] == "injected" and r["link_mbit"] == 200
        # (version 1: the warm-up delta, so that the follower holds a version a delta made)
        assert r["delta"]["version"] == 2 and r["delta_bytes"] < r["dense_bytes"] / 5
        assert math.isclose(r["payload_ratio"], r["dense_bytes"] / r["delta_bytes"])
        # the limiter holds the dense transfer to the link rate (a little over: its first burst)
        assert r["dense"] >= r["dense_bytes"] * 8 / 200e6 * 0.8
        assert r["floor"] >= r["wire"] > 0 and r["delta_over_floor"] > 0 and 0 < r["transport_share"] <= 1
        # the median beside the best: over every repetition, so never below the best
        times = r["delta_seconds_all"]
        assert len(times) == res["config"]["reps"] == 2 and min(times) == r["delta"]["seconds"]
        assert r["delta_median"] >= r["delta"]["seconds"] and r["median_over_floor"] >= r["delta_over_floor"]
        assert {"fetch", "apply", "digest"} <= set(r["delta"]["stages"])
        assert r["delta"]["cpu"] > 0  # the receiver's CPU time beside its wall time (a sync reads, decodes)
    (p,) = res["publish"]
    assert p["keyframe_publish"] > 0 and p["raw_put"] > 0
    models = {(e["model"], e["via"]) for e in res["extrapolated"]}
    assert ("1T", "relay tree k=4, 64 receivers") in models and all(e["extrapolated"] for e in res["extrapolated"])
    assert {p["source"] for p in res["published"]} == {"paper", "NeMo-RL"}


def test_fanout_bench_quick_crosses_the_slow_link_once_through_a_tree():
    pytest.importorskip("moto.moto_server.werkzeug_app")
    res = _run_json(bench.load("fanout"), ["--quick", "--json", "--elements", "300000", "--shaping", "proxy",
                                           "--reps", "2"])
    assert res["config"]["format_version"] == FORMAT_VERSION and res["config"]["reps"] == 2
    runs = {(r["receivers"], r["how"]): r for r in res["runs"]}
    for r in runs.values():  # the best of the row's two runs is kept, and the median beside it
        assert len(r["to_last_all"]) == 2 and round(r["to_last"], 4) == min(r["to_last_all"])
        assert r["to_last"] <= r["to_last_median"]
    assert set(runs) == {(1, "store"), (2, "store"), (1, "tree k=2"), (2, "tree k=2")}
    d = res["delta_bytes"]
    # two receivers on the store pull two copies over the slow link; through a tree one (plus
    # manifests and HEAD reads, well under one more copy)
    assert runs[(2, "store")]["slow_link_bytes"] >= 2 * d
    assert d <= runs[(2, "tree k=2")]["slow_link_bytes"] < 2 * d
    assert runs[(2, "tree k=2")]["relays"] == 1
    assert any(e["receivers"] == 1024 for e in res["extrapolated"])


def test_relay_tree_shape():
    """Enough relay levels for the receivers, each relay feeding at most k children."""
    ne = bench.load("netenv")
    import math as m
    for n, k in ((1, 2), (2, 2), (3, 2), (8, 2), (8, 4), (16, 4), (64, 4)):
        levels = max(1, m.ceil(m.log(n, k) - 1e-9))
        assert k ** levels >= n and (levels == 1 or k ** (levels - 1) < n), (n, k)
    m_store = ne.pipeline_model(1e9, 0.03, bytes_per_elem=0.05, link_bps=1e9, rtt=0.001, achieved=1.0,
                                receiver_s_per_elem=0.0, workers=1, receivers=8)
    m_tree = ne.pipeline_model(1e9, 0.03, bytes_per_elem=0.05, link_bps=1e9, rtt=0.001, achieved=1.0,
                               receiver_s_per_elem=0.0, workers=1, receivers=8, fanout=2)
    assert math.isclose(m_store["wire"], 8 * 0.05e9 * 8 / 1e9) and math.isclose(m_tree["wire"], 0.05e9 * 8 / 1e9)


def test_bench_child_logging_past_its_ready_line_does_not_block_on_its_pipe():
    """A relay logs on after its ready line; the bench's ``Proc`` reads its output all along, so
    the child finishes a 1 MB log (~16 pipes' worth) while nobody asks for a line, and the lines
    come back in order."""
    ne = bench.load("netenv")
    script = ("import sys\nprint('up: at here', flush=True)\n"
              "for i in range(20000): print(f'{i:06d}', 'x' * 40)\nprint('done', flush=True)\n")
    p = ne.Proc([sys.executable, "-c", script], "up:")
    try:
        assert p.wait_ready(60) == "at here"
        assert p.proc.wait(60) == 0  # (before: blocked on its ~64 KB pipe, never exited)
        lines = [p.readline(10) for _ in range(20001)]
        assert [x[:6] for x in lines[:-1]] == [f"{i:06d}" for i in range(20000)]
        assert lines[-1] == "done\n" and p.readline(10) == "" and p.readline(10) == ""
        assert p.tail[-1] == "done\n" and len(p.tail) == 200
    finally:
        p.stop()


def test_bench_child_that_never_says_ready_fails_with_its_output():
    ne = bench.load("netenv")
    p = ne.Proc([sys.executable, "-c", "print('starting', flush=True); import sys; sys.stdin.read()"], "up:",
                stdin=subprocess.PIPE)
    with pytest.raises(RuntimeError, match=r"never came within 2 s: starting"):
        p.wait_ready(2)
    assert p.proc.poll() is not None  # stopped, not left behind


def test_kernels_bench_quick_json():
    """bench/kernels.py --quick --json: every row of issue #12's table is there, measured, with its
    ratio to the same memcpy; every encode and apply was checked bit for bit inside the run."""
    kernels = _load_kernels()
    lib = kernels.native.lib()
    best = lib.dcr_sd_build() if lib is not None else None  # (the default setting: the best build)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = kernels.main(["--quick", "--json", "--changes", "0.01", "0.05"])
    assert rc == 0, err.getvalue()
    r = json.loads(out.getvalue())
    assert r["config"]["quick"] and r["config"]["elements"] == 1 << 22 and r["config"]["workers"] == 2
    assert len(r["memcpy_samples"]) == len(r["rows"]) + 1
    assert r["memcpy_seconds"] == statistics.median(r["memcpy_samples"]) > 0
    rows = {(row["change"], row["side"], row["path"]) for row in r["rows"]}
    for ch in (0.01, 0.05):
        for side, path in (("encode", "reference"), ("encode", "fast"), ("encode", "codec"), ("apply", "reference"),
                           ("apply", "fast"), ("apply", "follower"), ("apply", "unverified"), ("encode", "fast-v1"),
                           ("encode", "fast-scatter"), ("encode", "fast-scatter-many"), ("apply", "fast-v1"),
                           ("encode", "fast-v3"), ("encode", "fast-v4"), ("apply", "fast-v3"), ("apply", "fast-v4")):
            assert (ch, side, path) in rows
    for side, path in (("state_digest", "reference"), ("state_digest", "fast-def2"), ("keyframe", "raw_write"),
                       ("keyframe", "raw_write_writeback"), ("keyframe", "reference"),
                       ("keyframe", "fast"), ("keyframe", "fast-v1"), ("keyframe", "fast-v3"), ("keyframe", "fast-v4"),
                       ("keyframe", "fast-v3-sha256"), ("keyframe", "fast-v5-next"), ("keyframe", "fast-v5-alternated"),
                       ("keyframe", "fast-v5-copy-first"), ("keyframe_sync", "v4"),
                       ("keyframe_sync", "v4-sha256"),
                       ("tensor_digest", "sha256"),
                       ("tensor_digest", "blake3-1t"), ("tensor_digest", "blake3-2t"), ("values_digest", "blake2b"),
                       ("values_digest", "blake3")):
        assert (None, side, path) in rows
    from nemo_dcr.sync.publisher import Publisher
    assert isinstance(Publisher.__dict__["_keyframe_source"], staticmethod)  # the A/B's switch put back
    for row in r["rows"]:
        # every ratio is to the median of the memcpy samples: one at the start and one beside each row
        assert row["seconds"] > 0 and row["memcpy_seconds"] in r["memcpy_samples"]
        assert math.isclose(row["x_memcpy"], row["seconds"] / r["memcpy_seconds"])
        assert row["device"] == "cpu" and row["h2d_bytes"] == 0
        if row["change"] is not None:  # the synthetic step hits the asked change rate
            assert abs(row["change_rate"] - row["change"]) < 0.1 * row["change"]
    assert "| keyframe | raw_write |" in kernels.format_table(r)
    # the state digest on one thread: each width in each build this CPU runs, once, and the best
    # build set again after
    one_thread = {row["path"]: row for row in r["rows"] if row["side"] == "state_digest_1t"}
    if lib is None:
        assert not one_thread
    else:
        assert lib.dcr_sd_build() == best
        widths = {"uint8": 1, "bfloat16": 2, "float32": 4, "float64": 8}
        assert set(one_thread) == {f"{d} {kernels.SD_BUILDS[b]}" for d in widths for b in {best, min(best, 1), 0}} \
            | {f"{d} {kernels.SD_BUILDS[b]} def2" for d in widths for b in {min(best, 1), 0}}
        for path, row in one_thread.items():
            numel = 2 * r["config"]["elements"] // widths[path.split()[0]]  # the shard's bytes as that dtype
            assert math.isclose(row["ns_per_element"], 1e9 * row["seconds"] / numel)
        assert "ns an element)" in kernels.format_table(r)


def test_kernels_bench_device_hook_rows_join_the_table():
    """A device path registered in DEVICE_PATHS runs on the same tensors and lands in the rows."""
    kernels = _load_kernels()
    seen = []

    def fake_gpu(base, target, rate, workers, reps):
        seen.append((base.numel(), target.numel(), rate))
        return [kernels._row("encode", "fused", 1.0, 2.0, device="cuda", h2d_bytes=5, d2h_bytes=7)]

    kernels.DEVICE_PATHS.append(fake_gpu)
    base = kernels.make_shard(1 << 16)
    rows = kernels.encode_apply(base, kernels.make_target(base, 0.01), 0.01, 1, 1, memcpy=1e-3)
    assert seen == [(1 << 16, 1 << 16, 0.01)]
    fused = [r for r in rows if r["device"] == "cuda"]
    assert fused and fused[0]["x_memcpy"] == 0.5 and fused[0]["h2d_bytes"] == 5


def test_added_round_trip_holds_each_exchange_back_and_keeps_the_bytes():
    """``--rtt-ms`` (bench/netenv.py): a request through the region's proxy waits out the added
    round trip, and large bodies arrive intact and in order in both directions."""
    import http.server
    import threading
    import time
    import urllib.request

    body = bytes(range(256)) * 4096  # 1 MiB

    class Echo(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            data = self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data[::-1])

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    ne = bench.load("netenv")

    def through(url: str) -> None:
        assert url != f"http://127.0.0.1:{srv.server_address[1]}/x"
        t = time.perf_counter()
        got = urllib.request.urlopen(urllib.request.Request(url, data=body, method="POST"), timeout=30).read()
        took = time.perf_counter() - t
        assert got == body[::-1]
        assert took >= 0.05  # at least the added round trip (the request and its answer each held back)

    region = ne.Region("proxy", rtt=0.05)  # the in-process proxy (with the rate limiter's buckets)
    # and the proxy process a Region behind tc uses (there the added round trip alone)
    child = ne.delaying_proxy("127.0.0.1", srv.server_address[1], 0.025)
    try:
        through(region.reach(f"http://127.0.0.1:{srv.server_address[1]}/x"))
        assert "+50 ms" in region.kind
        assert child.proc.poll() is None and child.ready.isdigit()
        through(f"http://127.0.0.1:{child.ready}/x")
    finally:
        region.close()
        child.stop()
        srv.shutdown()
    assert child.proc.poll() is not None


def test_kernels_wide_steps_are_the_several_ulp_regime():
    """``--ulps K``: about the asked share of the elements moves, by two ulps or more as a rule,
    and the ``classes`` coding then costs over a byte per change (``auto`` tries the portable
    codings too): the regime the option is for."""
    import torch

    from nemo_dcr.codec import chunk, classes, ordered
    kernels = _load_kernels()
    base = kernels.make_shard(1 << 20)
    target = kernels.make_wide_target(base, 0.01, 3)
    ob, nb = base.view(torch.int16), target.view(torch.int16)
    moved = ob != nb
    assert 0.005 < float(moved.float().mean()) <= 0.0105
    ulps = (ordered.encode(ob[moved], nb[moved], True).to(torch.int64) + 1) // 2  # |d| from its zigzag
    assert float(ulps.float().mean()) > 1.5 and float((ulps >= 2).float().mean()) > 0.5
    k, rows, pb, vb = classes.encode(ob, nb, classes.MANTISSA[torch.bfloat16])[:4]
    assert len(pb) + len(vb) > chunk.CLASSES_ENOUGH * k


def test_files_bench_quick_json():
    """bench/files.py --quick --json: the copy, diff and apply rows, each ratio to the copy, the
    apply's files checked against the target's inside the run (it raises otherwise)."""
    files = bench.load("files")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = files.main(["--quick", "--json"])
    assert rc == 0, err.getvalue()
    r = json.loads(out.getvalue())
    assert r["config"]["quick"] and r["config"]["tensors"] == 16 and r["config"]["elements_per_tensor"] == 1 << 18
    rows = {row["path"]: row for row in r["rows"]}
    assert list(rows) == ["copy", "diff", "apply"]
    for row in rows.values():
        assert row["seconds"] > 0 and math.isclose(row["x_copy"], row["seconds"] / rows["copy"]["seconds"])
    assert 0 < r["delta_bytes"] < r["config"]["bytes"] / 10  # 1 % changed: a delta, not a copy
    assert "| apply |" in files.format_table(r)


@pytest.mark.parametrize("trainer", ["rows", "columns"])
def test_ranks_bench_quick_json(trainer):
    """bench/ranks.py --quick --json: real rank processes (gloo) publish their row shards (or,
    as a tensor-parallel trainer, their column blocks), and a follower holding the tensors whole
    and two TP=2 groups sync them, their bits checked against the target inside the run (it
    raises otherwise); each ratio is to the one-rank cell of its path."""
    ranks = bench.load("ranks")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = ranks.main(["--quick", "--json", "--trainer-cut", trainer])
    assert rc == 0, err.getvalue()
    r = json.loads(out.getvalue())
    assert r["config"]["quick"] and r["config"]["ranks"] == [1, 4] and r["config"]["tensors"] == 64
    assert r["config"]["trainer_cut"] == trainer
    rows = {(row["ranks"], row["path"]): row for row in r["rows"]}
    assert set(rows) == {(n, p) for n in (1, 4) for p in ranks.PATHS}
    for (n, p), row in rows.items():
        assert row["entries"] == 64 * n and row["delta_bytes"] > 0
        assert row["seconds"] > 0 and math.isclose(row["x_one"], row["seconds"] / rows[1, p]["seconds"])
    table = ranks.format_table(r)
    assert "| delta sync |" in table and f"4 ranks {rows[4, 'delta sync']['delta_bytes'] / 1e3:.0f} KB" in table


def test_tensors_bench_quick_json():
    """bench/tensors.py --quick --json: the four paths for each tensor count, each ratio to the
    one-tensor cell of its path; both followers' bits checked against the target inside the run
    (it raises otherwise)."""
    tensors = bench.load("tensors")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = tensors.main(["--quick", "--json"])
    assert rc == 0, err.getvalue()
    r = json.loads(out.getvalue())
    assert r["config"]["quick"] and r["config"]["tensors"] == [1, 16, 256] and r["config"]["elements"] == 8 << 20
    rows = {(row["tensors"], row["path"]): row for row in r["rows"]}
    assert set(rows) == {(n, p) for n in (1, 16, 256) for p in tensors.PATHS}
    for (_n, p), row in rows.items():
        assert row["seconds"] > 0 and math.isclose(row["x_one"], row["seconds"] / rows[1, p]["seconds"])
    assert "| delta sync |" in tensors.format_table(r)


def test_fuzz_bench_without_atheris_says_so_and_runs_nothing(monkeypatch, tmp_path, capsys):
    """Without atheris every target's process failed at its first line, each reported only as
    ``exit 1``: the driver now says what is missing before starting any."""
    fuzz = bench.load("fuzz")
    real = fuzz.importlib.util.find_spec
    monkeypatch.setattr(fuzz.importlib.util, "find_spec",
                        lambda name, *a: None if name == "atheris" else real(name, *a))
    ran = []
    monkeypatch.setattr(fuzz, "run_target", lambda *a: ran.append(a))
    rc = fuzz.main(["--inputs", "10", "--artifacts", str(tmp_path / "a"), "--corpus", str(tmp_path / "c")])
    assert rc == 2 and ran == []
    assert "needs atheris" in capsys.readouterr().err


def test_fuzz_version_fixtures_keep_bytes_and_leave_no_directory(monkeypatch, tmp_path):
    """The manifest and HEAD targets' fixtures (a small published store, unsigned and signed) keep
    the bytes they read and remove the store: a directory per fixture was left in /tmp by every
    run of those targets."""
    import tempfile
    fuzz = bench.load("fuzz")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    fx = fuzz.VersionFixtures()
    assert len(fx.heads) == 6 and len(fx.manifests) == 6
    assert all(b.startswith(b"{") for b in fx.heads) and all(b.startswith(b"{") for _, b in fx.manifests)
    assert list(tmp_path.iterdir()) == []
