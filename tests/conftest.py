"""Fixtures only; the helpers tests import are in the dcr_testing package beside this file."""
import functools
import os
import shutil
import tempfile

# The device path's Triton kernels run on CPU tensors in Triton's interpreter in this suite; the
# mode is fixed when a kernel is defined, so before any test imports nemo_dcr.device. On a GPU
# the kernels are checked by tests/gpu/run_gpu.py, outside pytest.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from dcr_testing.cli import console_script, run_cli
from dcr_testing.s3 import make_s3_store, moto_server


@pytest.fixture(scope="session", autouse=True)
def _session_tmpdir():
    """The temporary files of the processes tests start, in one directory per test process that
    is removed at its end. vLLM puts its engines' ZMQ sockets in the temporary directory and
    leaves them there; a relay killed with SIGKILL (as the fault tests do) cannot remove its
    cache directory. test_vllm_engine.py alone left 27 in /tmp; this machine's held ~2,500 after
    a day of runs."""
    d = tempfile.mkdtemp(prefix="nemo-dcr-tests-")
    saved = {k: os.environ.get(k) for k in ("TMPDIR", "VLLM_RPC_BASE_PATH")}
    # TMPDIR for child processes; vLLM's variable for engines started in this one (whose
    # tempfile module has its directory already)
    os.environ.update(TMPDIR=d, VLLM_RPC_BASE_PATH=d)
    yield d
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def moto_s3():
    """One moto S3 server on 127.0.0.1 over HTTP for the session (see dcr_testing.s3)."""
    with moto_server() as moto:
        yield moto


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    """A fresh, empty store: a LocalStore in tmp_path, or an S3Store on the moto server."""
    if request.param == "local":
        from nemo_dcr.stores import LocalStore
        return LocalStore(tmp_path / "store")
    return make_s3_store(request.getfixturevalue("moto_s3"), request)


@pytest.fixture(params=[1, 2], ids=["def1", "def2"])
def definition(request):
    """The state digest's definition of the weights (docs/format.md, "State digest"): a test
    that takes it runs under both."""
    return request.param


@pytest.fixture
def cli(capsys):
    """``cli("diff", a, b, "-o", out)``: run ``nemo-dcr`` in this process -> CliResult
    (returncode, stdout, stderr)."""
    return functools.partial(run_cli, capsys)


@pytest.fixture
def nemo_dcr_cmd():
    """The installed console script, next to the running interpreter (for the subprocess smoke tests)."""
    return console_script()


def pytest_terminal_summary(terminalreporter):
    """How many real vLLM engines the session started (they are most of `make test-vllm`'s time)."""
    import sys
    vm = sys.modules.get("dcr_testing.vllm_models")
    if vm is not None and any(vm.STARTS.values()):
        terminalreporter.write_line(f"vLLM engines started: {vm.STARTS['engine']} in this test process, each the "
                                    "default way (engine-core and worker processes)")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Under ``--dist loadgroup`` (``make test-vllm``) pytest-xdist keeps the tests of an
    ``xdist_group`` in one process by adding the group to their node ids; a module fixture's
    engines then start once. pytest 9 ignores the way xdist 3.8 sets those ids, and the groups
    fell apart without a word: each test process started the module's engines again (~1.5 min
    of the suite). Such a test fails here, before its fixtures start anything."""
    if getattr(item.config.option, "loadgroup", False) and item.get_closest_marker("xdist_group") is not None \
            and "@" not in item.nodeid:
        pytest.fail(f"pytest-xdist's --dist loadgroup did not group {item.nodeid} under this pytest "
                    f"({pytest.__version__}); the vLLM venv pins pytest < 9 (Makefile, VLLM_TEST_DEPS)", pytrace=False)


# vLLM's CPU backend shares memory between the ranks of a tensor-parallel engine through files in
# /dev/shm (vllm_dist_<id>-tp:...-cpushm_<rank>, 4 MiB each), which only a clean shutdown of every
# rank removes; the engines these tests stop or kill left ~40 MB per `make test-vllm`. The
# controlling process (not an xdist worker, whose engines may still run in another worker) removes
# those the session made once it ends, except any a live process still maps or holds open.
_SHM = "/dev/shm"
_SHM_BEFORE: set = set()


def _vllm_segments() -> set:
    try:
        return {n for n in os.listdir(_SHM) if n.startswith("vllm_dist_")}
    except OSError:
        return set()


def _in_use() -> set:
    """The /dev/shm files some process maps or holds open."""
    used = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as f:
                used.update(line.split(None, 5)[5].strip() for line in f if f"{_SHM}/" in line)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                used.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except (OSError, IndexError):
            continue  # gone, or not ours to read
    return {os.path.basename(u) for u in used if u.startswith(f"{_SHM}/")}


def pytest_sessionstart(session):
    _SHM_BEFORE.update(_vllm_segments())


def pytest_sessionfinish(session):
    if hasattr(session.config, "workerinput"):
        return
    left = _vllm_segments() - _SHM_BEFORE
    if left:
        for name in left - _in_use():
            try:
                os.unlink(os.path.join(_SHM, name))
            except OSError:
                pass
