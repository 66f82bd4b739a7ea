"""One way to fail across ranks (issue 9): ``Group.run`` in a real gloo group of 4 processes. A
rank that raises a specific error makes every rank raise the same typed error naming it (the
failed rank with its own exception as ``__cause__``); the Follower and the Publisher report a
rank's failure that way. Workers: dcr_testing/mp_rank_failures.py."""
import time

import pytest

from dcr_testing import mp_rank_failures as M
from dcr_testing.procs import launch

PRELOAD = []  # dcr_testing.procs.PRELOAD covers what the ranks import
WORLD = 4


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rank-failures")
    out = tmp / f"out-{time.monotonic_ns()}"
    out.mkdir()
    spec = {"kind": "local", "root": str(tmp / "store")}
    res, codes, hung = launch(M.main, WORLD, lambda r, port: (r, WORLD, port, spec, str(out)), out, 90.0, PRELOAD)
    assert not hung, f"ranks {hung} hung; exit codes {codes}"
    bad = [r for r in range(WORLD) if not res.get(r, {}).get("ok")]
    assert not bad, "\n".join(f"rank {r}:\n{res.get(r, {}).get('traceback')}" for r in bad)
    return res


def test_a_typed_error_on_one_rank_is_raised_alike_on_every_rank(results):
    for r in range(WORLD):
        e = results[r]["typed"]
        assert e["type"] == "CorruptObjectError", (r, e)
        assert e["ranks"] == [2] and e["failure_types"] == {"2": "CorruptObjectError"}
        assert e["message"].startswith("download version 7 failed: rank 2: CorruptObjectError: object "
                                       "versions/x/part-00002.dcr is corrupt (injected)")
        # the failed rank keeps its own exception as the cause; the others have none
        assert e["cause"] == ("CorruptObjectError" if r == 2 else None)
    assert len({results[r]["typed"]["message"] for r in range(WORLD)}) == 1


def test_different_errors_on_several_ranks_give_one_group_error_naming_each(results):
    for r in range(WORLD):
        e = results[r]["mixed"]
        assert e["type"] == "GroupError" and e["ranks"] == [1, 2]
        assert e["failure_types"] == {"1": "OSError", "2": "ValueError"}
        assert "rank 1: OSError: disk full (injected)" in e["message"]
        assert "rank 2: ValueError: bad value (injected)" in e["message"]
        assert e["cause"] == {1: "OSError", 2: "ValueError"}.get(r)


def test_results_are_gathered_or_taken_from_one_rank(results):
    for r in range(WORLD):
        assert results[r]["gathered"] == [0, 10, 20, 30]
        assert results[r]["from_src"] == "rank 1"


def test_a_nested_failure_keeps_naming_the_rank_that_failed(results):
    for r in range(WORLD):
        e = results[r]["nested"]
        assert e["type"] == "CorruptObjectError" and e["ranks"] == [2]
        assert e["message"].startswith("outer step failed: rank 2: CorruptObjectError: object")


def test_follower_download_failure_on_one_rank_is_the_same_typed_error_everywhere(results):
    for r in range(WORLD):
        e = results[r]["follower"]
        assert e is not None, f"rank {r} synced although rank 1 could not download"
        assert e["type"] == "CorruptObjectError" and e["ranks"] == [1], (r, e)
        assert "injected download failure" in e["message"]
        assert results[r]["follower_version"] is None


def test_publisher_upload_failure_is_a_publish_error_naming_the_rank_everywhere(results):
    for r in range(WORLD):
        e = results[r]["publish"]
        assert e["type"] == "PublishError" and e["ranks"] == [1], (r, e)
        assert e["failure_types"] == {"1": "OSError"}
        assert "rank 1: OSError: injected upload failure" in e["message"] and "no version committed" in e["message"]
        assert e["cause"] == ("OSError" if r == 1 else None)
