"""Smoke test of the codec benchmark: bench/codec.py --quick --json runs and reports sane numbers."""
import contextlib
import importlib.util
import io
import json
import math
import pathlib
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench" / "codec.py"


def _load_codec():
    name = "nemo_dcr_bench_codec"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCH)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


@pytest.fixture(scope="module")
def result():
    codec = _load_codec()
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = codec.main(["--quick", "--json"])
    assert rc == 0, err.getvalue()
    return json.loads(out.getvalue())


def test_shape(result):
    c = result["config"]
    assert c["quick"] and c["steps"] >= 1 and len(c["lrs"]) >= 1
    assert len(result["pairs"]) == c["steps"] * len(c["lrs"])
    assert result["machine"]["cpus"] >= 1
    assert "all" in result["summary"]


def test_pairs_sane(result):
    for p in result["pairs"]:
        what = f"lr {p['lr']} pair {p['step_from']}->{p['step_to']}"
        assert p["apply_verified"] is True, what
        assert p["dense_bytes"] == 2 * p["elements"], what  # BF16
        assert 0 < p["changed"] <= p["elements"], what
        assert math.isclose(p["change_rate"], p["changed"] / p["elements"]), what
        b, pay = p["bytes"], p["payload_bytes"]
        # mixed picks the smaller value stream per chunk over the same positions: its payload can
        # never exceed either pure encoding's ...
        assert pay["auto"] <= min(pay["xor"], pay["overwrite"]), what
        # ... and its total only by header bytes (the header records every encoding tried)
        assert b["auto"] <= min(b["xor"], b["overwrite"]) * 1.01 + 256, what
        assert b["auto"] == pay["auto"] + p["mixed_streams"]["header"], what
        for e in ("overwrite", "xor", "auto"):
            assert math.isclose(p["bytes_per_changed"][e], b[e] / p["changed"]), what
        assert math.isclose(p["ratio_dense_to_mixed"], p["dense_bytes"] / b["auto"]), what
        assert p["ratio_dense_to_mixed"] > 1, what
        for k in ("memcpy", "diff", "apply"):
            assert p["time_s"][k] > 0 and p["gbps"][k] > 0, what
        assert p["x_memcpy"]["diff"] > 0 and p["x_memcpy"]["apply"] > 0, what


def test_bit_exact_check_fails_loudly():
    codec = _load_codec()
    import torch
    a = {"w": torch.zeros(4, dtype=torch.bfloat16)}
    b = {"w": torch.tensor([0.0, -0.0, 0.0, 0.0], dtype=torch.bfloat16)}  # equal as floats, not as bits
    with pytest.raises(codec.BenchError, match="NOT BIT-EXACT"):
        codec.check_equal(a, b, "test")
