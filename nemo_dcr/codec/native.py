"""The C kernels of csrc/, compiled into the package when it is built, called through ctypes.

``pip wheel .`` / ``pip install .`` / ``pip install -e .`` compile csrc/ into
``nemo_dcr/codec/libdcr.so`` (setup.py): a platform wheel carries it, so nothing is compiled
where the package runs and no compiler is needed there. One library serves every CPU of its
architecture: the AVX-512BW and AVX2 scans are compiled beside the scalar ones (per-function
target attributes) and the library picks by the CPU's features on its first call
(``simd_level()``; csrc/README.md).

Without the library (a platform no wheel was built for, an install whose compile failed) the
PyTorch reference runs: byte-for-byte the same output, ~150-200x slower; the first use says so
once, loudly, with how to get the library. ``NEMO_DCR_NATIVE=0`` chooses the reference (quietly).

A source checkout (csrc/ and setup.py beside the package) is a developer's tree, used with
``pip install -e .`` or through PYTHONPATH. There, and only there, the library may be built at
run time into ``$NEMO_DCR_CACHE`` (default ``~/.cache/nemo-dcr``), named by a hash of the sources
and flags, with setup.py's own command: when ``pip install -e .`` has not built it yet, when the
sources changed since it did (the library names the sources it was built from), and for a
variant with ``NEMO_DCR_NATIVE_CFLAGS`` (extra flags, e.g. ``-fsanitize=address -g -O1`` for
bench/fuzz.py's AddressSanitizer run; such a build never replaces the normal one). An installed
package never compiles.
"""
from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import logging
import os
import subprocess
import threading
from pathlib import Path

import numpy as np

from nemo_dcr.util.atomic import replacing

LIBRARY = Path(__file__).resolve().parent / "libdcr.so"  # built by setup.py
CHECKOUT = Path(__file__).resolve().parents[2]          # a source checkout's root, if this is one
EXTRA_CFLAGS_ENV = "NEMO_DCR_NATIVE_CFLAGS"
GET_IT = ("install a platform wheel of nemo-dcr (`pip wheel .` in a checkout makes one: "
          "nemo_dcr-*-py3-none-<platform>.whl), or install from source with a C compiler on PATH "
          "(`pip install .`, or `pip install -e .` in a checkout); NEMO_DCR_NATIVE=0 chooses the reference quietly")
SIMD_NAMES = {2: "AVX-512BW", 1: "AVX2", 0: "scalar"}

log = logging.getLogger(__name__)
_lock = threading.Lock()
_lib = None
_held = None  # the same library, its calls keeping the GIL (held())
_tried = False
build_error: str | None = None  # why the kernels are not in use, when they are not
origin: str | None = None       # where the loaded library came from: "packaged", "checkout build", "variant build"


def _cache_dir() -> Path:
    return Path(os.environ.get("NEMO_DCR_CACHE") or Path.home() / ".cache" / "nemo-dcr")


def _recipe():
    """The checkout's setup.py (its build description: ``SOURCES``, ``source_hash``,
    ``compile_command``), or None outside a source checkout."""
    setup_py, csrc = CHECKOUT / "setup.py", CHECKOUT / "csrc"
    if not (setup_py.is_file() and csrc.is_dir()):
        return None
    spec = importlib.util.spec_from_file_location("_nemo_dcr_setup", setup_py)
    if spec is None or spec.loader is None:
        return None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # defines the recipe; setup() runs only as __main__
    return mod


def _checkout_build(recipe, extra: list[str]) -> Path:
    """Build the checkout's csrc/ with setup.py's command into the cache (named by a hash of the
    sources, compiler and flags: each variant apart, concurrent builds each to a temporary name)."""
    cc = os.environ.get("CC", "cc")
    tag = hashlib.sha256(" ".join([recipe.source_hash(), cc, *extra]).encode()).hexdigest()[:16]
    out = _cache_dir() / f"libdcr-{tag}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with replacing(str(out)) as tmp:
        try:
            r = subprocess.run(recipe.compile_command(cc, tmp, extra=extra), capture_output=True, text=True)
        except OSError as e:  # no such compiler
            raise OSError(f"{cc} failed: {e}") from None
        if r.returncode != 0:
            raise OSError(f"{cc} failed: {r.stderr.strip()[:500]}")
    return out


def _declare(lib) -> None:
    i64, p = ctypes.c_int64, ctypes.c_void_p
    lib.dcr_cls_encode.restype = i64
    lib.dcr_cls_encode.argtypes = [p, p, i64, ctypes.c_int, ctypes.c_int, p, p, p, p, p, p, p, p, p]
    lib.dcr_cls_encode_wb.restype = i64
    lib.dcr_cls_encode_wb.argtypes = [p, p, i64, ctypes.c_int, ctypes.c_int, p, p, p, p, p, p, p, p, p, p]
    lib.dcr_cls_encode_ranked.restype = i64
    lib.dcr_cls_encode_ranked.argtypes = [p, p, p, p, i64, ctypes.c_int, ctypes.c_int, p, p, p, p, p, p]
    lib.dcr_cls_decode.restype = ctypes.c_int
    lib.dcr_cls_decode.argtypes = [p, i64, ctypes.c_int, ctypes.c_int, p, i64, p, i64, p, i64, i64, p, p]
    lib.dcr_cls_decode_old.restype = ctypes.c_int
    lib.dcr_cls_decode_old.argtypes = [p, i64, ctypes.c_int, ctypes.c_int, p, i64, p, i64, p, i64, i64, p, p, p, i64]
    lib.dcr_cls_decode_into.restype = ctypes.c_int
    lib.dcr_cls_decode_into.argtypes = [p, i64, ctypes.c_int, ctypes.c_int, p, i64, p, i64, p, i64, i64, p, p, p, i64]
    lib.dcr_cls_decode_streams.restype = ctypes.c_int
    lib.dcr_cls_decode_streams.argtypes = [i64, ctypes.c_int, ctypes.c_int, p, i64, p, i64, p, i64, i64, p, p, p]
    lib.dcr_cls_decode_streams_many.restype = ctypes.c_int
    lib.dcr_cls_decode_streams_many.argtypes = [i64] + [p] * 14
    lib.dcr_cls_run_counts.restype = ctypes.c_int
    lib.dcr_cls_run_counts.argtypes = [p, i64, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, p, p, i64, p]
    lib.dcr_cls_run_select.restype = ctypes.c_int
    lib.dcr_cls_run_select.argtypes = [p, i64, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, p, p, i64, p, p,
                                       p, i64, p]
    lib.dcr_cls_run_counts_many.restype = ctypes.c_int
    lib.dcr_cls_run_counts_many.argtypes = [i64] + [p] * 12
    lib.dcr_cls_run_select_many.restype = ctypes.c_int
    lib.dcr_cls_run_select_many.argtypes = [i64] + [p] * 16
    lib.dcr_cls_place_many.restype = ctypes.c_int
    lib.dcr_cls_place_many.argtypes = [i64] + [p] * 4 + [i64] + [p] * 7
    lib.dcr_free.restype = None
    lib.dcr_free.argtypes = [p]
    lib.dcr_set_simd.restype = None
    lib.dcr_set_simd.argtypes = [ctypes.c_int]
    lib.dcr_sd_build.restype = ctypes.c_int
    lib.dcr_sd_build.argtypes = []
    lib.dcr_simd_level.restype = ctypes.c_int
    lib.dcr_simd_level.argtypes = []
    lib.dcr_simd_pdep.restype = ctypes.c_int
    lib.dcr_simd_pdep.argtypes = []
    lib.dcr_source_hash.restype = ctypes.c_char_p
    lib.dcr_source_hash.argtypes = []
    lib.dcr_sd_contrib.restype = ctypes.c_int
    lib.dcr_sd_contrib.argtypes = [p, ctypes.c_int, p, i64, i64, ctypes.c_uint32,
                                   ctypes.c_uint32, p, p, p, p, ctypes.c_int]
    lib.dcr_sd_contrib_many.restype = ctypes.c_int
    lib.dcr_sd_contrib_many.argtypes = [i64, p, p, p, p, p, p, p, p, p, p, ctypes.c_int]
    lib.dcr_sd_contrib_runs.restype = ctypes.c_int
    lib.dcr_sd_contrib_runs.argtypes = [p, ctypes.c_int, p, i64, i64, ctypes.c_uint32,
                                        ctypes.c_uint32, p, p, p, p, ctypes.c_int]
    lib.dcr_sd_change.restype = ctypes.c_int
    lib.dcr_sd_change.argtypes = [p, p, ctypes.c_int, p, i64, i64,
                                  ctypes.c_uint32, ctypes.c_uint32, p, p, p, ctypes.c_int]
    lib.dcr_sd_change_in.restype = ctypes.c_int
    lib.dcr_sd_change_in.argtypes = [p, p, ctypes.c_int, p, i64, i64,
                                     ctypes.c_uint32, ctypes.c_uint32, p, p, p, ctypes.c_int]
    lib.dcr_sd_change_acc.restype = ctypes.c_int
    lib.dcr_sd_change_acc.argtypes = [p, p, ctypes.c_int, p, i64, i64,
                                      ctypes.c_uint32, ctypes.c_uint32, p, p, p, ctypes.c_int]
    lib.dcr_sdb_table.restype = None
    lib.dcr_sdb_table.argtypes = [p]
    lib.dcr_sdb_build.restype = ctypes.c_int
    lib.dcr_sdb_build.argtypes = []
    for f in (lib.dcr_planes_split, lib.dcr_planes_join):
        f.restype = ctypes.c_int
        f.argtypes = [p, i64, ctypes.c_int, p]
    lib.dcr_planes_join_runs.restype = ctypes.c_int
    lib.dcr_copy_runs.restype = ctypes.c_int
    lib.dcr_copy_runs.argtypes = [p, i64, p, i64, ctypes.c_int, p, p, p, i64]
    lib.dcr_planes_join_runs.argtypes = [p, i64, ctypes.c_int, p, i64, p, p, p, i64]
    lib.dcr_crc32.restype = ctypes.c_int
    lib.dcr_crc32.argtypes = [p, i64, ctypes.c_uint32, p]
    lib.dcr_i64_range.restype = ctypes.c_int
    lib.dcr_i64_range.argtypes = [p, i64, p, p]
    lib.dcr_gaps_len.restype = i64
    lib.dcr_gaps_len.argtypes = [p, i64]
    lib.dcr_gaps_encode.restype = i64
    lib.dcr_gaps_encode.argtypes = [p, i64, p]
    lib.dcr_gaps_decode.restype = ctypes.c_int
    lib.dcr_gaps_decode.argtypes = [p, i64, i64, i64, p, p]
    lib.dcr_ordered.restype = ctypes.c_int
    lib.dcr_ordered.argtypes = [p, p, i64, ctypes.c_int, ctypes.c_int, ctypes.c_int, p]


def buffer_address(buf) -> tuple[np.ndarray, int]:
    """(holder, address) of a contiguous bytes-like ``buf`` (read-only is fine: a download's
    buffer, ``bytes``) for a kernel call, without a copy; keep ``holder`` until the call returns.
    The address comes from numpy's array interface: ``ndarray.ctypes`` makes a reference cycle,
    which kept each payload alive until a garbage collection."""
    a = np.frombuffer(buf, dtype=np.uint8)
    return a, a.__array_interface__["data"][0]


def _load(path: Path):
    loaded = ctypes.CDLL(str(path))
    _declare(loaded)
    return loaded


def held():
    """The loaded library with calls that keep the GIL (``ctypes.PyDLL``), or None. For calls of
    tens of microseconds made between a chunk's other calls (a CRC of a chunk's payload, the
    state digest's change of a chunk's changes): ``lib()``'s calls give the GIL up, and on a busy
    machine taking it back waited for whichever thread held it and for a core, ~0.4 ms for a CRC
    of 20 us on a 2-core machine. A call that keeps it holds back the other threads' Python for
    its own length only (docs/results.md, eighteenth turn). Long calls (a chunk's decode, a
    whole tensor's digest) go through ``lib()``: the other threads run meanwhile."""
    global _held
    loaded = lib()  # None where the kernels are off (NEMO_DCR_NATIVE=0, or a test's reference run)
    if loaded is None:
        return None
    h = _held
    if h is None or h._name != loaded._name:
        h = ctypes.PyDLL(loaded._name)  # the library loaded already: the same copy, not a second
        _declare(h)
        _held = h
    return h


def _find():
    """-> (library, origin). OSError says why there is none."""
    extra = os.environ.get(EXTRA_CFLAGS_ENV, "").split()
    recipe = _recipe()
    if extra:
        if recipe is None:
            raise OSError(f"{EXTRA_CFLAGS_ENV} builds a variant of the kernels from a source checkout; "
                          "this is an installed package")
        return _load(_checkout_build(recipe, extra)), "variant build"
    if LIBRARY.exists():
        packaged = _load(LIBRARY)
        if recipe is None or packaged.dcr_source_hash().decode() == recipe.source_hash():
            return packaged, "packaged"
        log.warning("nemo-dcr: %s was built from other sources than this checkout's csrc/ (edited since "
                    "`pip install -e .`); building them for this process (`pip install -e .` rebuilds it)", LIBRARY)
        return _load(_checkout_build(recipe, [])), "checkout build"
    if recipe is not None:
        log.warning("nemo-dcr: this source checkout has no built kernels (%s; `pip install -e .` or `make venv` "
                    "builds them); building them for this process", LIBRARY)
        return _load(_checkout_build(recipe, [])), "checkout build"
    raise OSError(f"{LIBRARY.name} is not in the installed package (a platform without a wheel, or an install "
                  "whose compile failed)")


def lib():
    """The loaded library, or None (then ``build_error`` says why)."""
    global _lib, _tried, build_error, origin
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        if os.environ.get("NEMO_DCR_NATIVE", "1") == "0":
            build_error = "disabled by NEMO_DCR_NATIVE=0"
        else:
            try:
                _lib, origin = _find()
            except (OSError, AttributeError) as e:  # AttributeError: a library without a symbol we call
                build_error = str(e)
        if _lib is None and build_error != "disabled by NEMO_DCR_NATIVE=0":
            # Said once per process, at WARNING (printed even where logging is not set up): the
            # reference gives the same bytes but so much slower that a user would otherwise
            # only notice a slow run.
            log.warning("nemo-dcr: the compiled kernels are unavailable (%s). Using the PyTorch reference: the same "
                        "bytes, but ~150-200x slower (a 16M-element BF16 diff takes ~19 s instead of ~0.13 s, its "
                        "apply ~24 s instead of ~0.12 s). To get them: %s.", build_error, GET_IT)
        _tried = True
    return _lib


def backend() -> str:
    """Which codec backend runs the ``classes`` coding: ``"native"`` (the C kernel) or
    ``"reference"`` (the PyTorch reference; ``build_error`` says why)."""
    return "native" if lib() is not None else "reference"


def simd_level() -> int | None:
    """What the library's 2-byte scans run on this CPU: 2 AVX-512BW, 1 AVX2, 0 scalar (None
    without the library)."""
    loaded = lib()
    return None if loaded is None else int(loaded.dcr_simd_level())


def describe() -> str:
    """``backend()`` with what the native one runs and where it came from, e.g. ``native, AVX2 +
    pdep scans, packaged``; the reference with why."""
    level = simd_level()
    if level is None:
        return f"reference: {build_error}"
    # (AVX2 with or without pdep: a core where it is slow selects a block's bit another way)
    loaded = lib()
    pdep = " + pdep" if level == 1 and loaded is not None and loaded.dcr_simd_pdep() else ""
    return f"native, {SIMD_NAMES.get(level, level)}{pdep} scans, {origin}"
