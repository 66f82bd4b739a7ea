"""The C kernels of codec/csrc/ (package data), built at first use and called through ctypes.

The shared library is compiled with the system C compiler into a cache directory
(``$NEMO_DCR_CACHE``, default ``~/.cache/nemo-dcr``), named by a hash of the source, so a
changed source rebuilds and concurrent first uses do not clash (each builds to a temporary
name and renames). Nothing here is needed for correctness: without a compiler, or with
``NEMO_DCR_NATIVE=0``, the PyTorch reference (byte-for-byte the same output) is used.

``NEMO_DCR_NATIVE_CFLAGS`` adds compiler flags (split on whitespace), e.g. ``-fsanitize=address
-g -O1`` for the fuzz run of bench/fuzz.py; they are part of the cache name, so such a build never
replaces the normal one.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import threading
from pathlib import Path

from nemo_dcr.util.atomic import replacing

SOURCE = Path(__file__).resolve().parent / "csrc" / "dcr_classes.c"  # package data: ships in the wheel
CFLAGS = ["-O3", "-std=c99", "-shared", "-fPIC"]
EXTRA_CFLAGS_ENV = "NEMO_DCR_NATIVE_CFLAGS"

log = logging.getLogger(__name__)
_lock = threading.Lock()
_lib = None
_tried = False
build_error: str | None = None  # why the kernels are not in use, when they are not


def _cache_dir() -> Path:
    return Path(os.environ.get("NEMO_DCR_CACHE") or Path.home() / ".cache" / "nemo-dcr")


def _build(src: Path) -> Path:
    # the headers it includes are part of what is built: a change to either makes a new build
    text = src.read_bytes() + b"".join(h.read_bytes() for h in sorted(src.parent.glob("*.h")))
    cc = os.environ.get("CC", "cc")
    flags = CFLAGS + os.environ.get(EXTRA_CFLAGS_ENV, "").split()  # later flags win (-O1 over -O3)
    tag = hashlib.sha256(text + " ".join([cc] + flags).encode()).hexdigest()[:16]
    out = _cache_dir() / f"dcr_classes-{tag}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with replacing(str(out)) as tmp:  # concurrent first uses each build their own, then rename
        r = subprocess.run([cc, *flags, "-o", tmp, str(src)], capture_output=True, text=True)
        if r.returncode != 0:
            raise OSError(f"{cc} failed: {r.stderr.strip()[:500]}")
    return out


def _declare(lib) -> None:
    i64, p = ctypes.c_int64, ctypes.c_void_p
    lib.dcr_cls_encode.restype = i64
    lib.dcr_cls_encode.argtypes = [p, p, i64, ctypes.c_int, ctypes.c_int, p, p, p, p, p, p, p, p, p]
    lib.dcr_cls_encode_ranked.restype = i64
    lib.dcr_cls_encode_ranked.argtypes = [p, p, p, p, i64, ctypes.c_int, ctypes.c_int, p, p, p, p, p, p]
    lib.dcr_cls_decode.restype = ctypes.c_int
    lib.dcr_cls_decode.argtypes = [p, i64, ctypes.c_int, ctypes.c_int, p, i64, p, i64, p, i64, i64, p, p]
    lib.dcr_cls_decode_old.restype = ctypes.c_int
    lib.dcr_cls_decode_old.argtypes = [p, i64, ctypes.c_int, ctypes.c_int, p, i64, p, i64, p, i64, i64, p, p, p]
    lib.dcr_cls_decode_streams.restype = ctypes.c_int
    lib.dcr_cls_decode_streams.argtypes = [i64, ctypes.c_int, ctypes.c_int, p, i64, p, i64, p, i64, i64, p, p, p]
    lib.dcr_free.restype = None
    lib.dcr_free.argtypes = [p]
    lib.dcr_set_simd.restype = None
    lib.dcr_set_simd.argtypes = [ctypes.c_int]
    lib.dcr_sd_contrib.restype = ctypes.c_int
    lib.dcr_sd_contrib.argtypes = [p, ctypes.c_int, p, i64, i64, ctypes.c_uint32, ctypes.c_uint32, p, p, p, p]
    lib.dcr_sd_change.restype = ctypes.c_int
    lib.dcr_sd_change.argtypes = [p, p, ctypes.c_int, p, i64, i64, ctypes.c_uint32, ctypes.c_uint32, p, p, p]


def lib():
    """The loaded library, or None (then ``build_error`` says why)."""
    global _lib, _tried, build_error
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        if os.environ.get("NEMO_DCR_NATIVE", "1") == "0":
            build_error = "disabled by NEMO_DCR_NATIVE=0"
        elif not SOURCE.exists():
            build_error = f"{SOURCE} not found"
        else:
            try:
                loaded = ctypes.CDLL(str(_build(SOURCE)))
                _declare(loaded)
                _lib = loaded
            except OSError as e:
                build_error = str(e)
        if _lib is None and build_error != "disabled by NEMO_DCR_NATIVE=0":
            # Said once per process: the reference gives the same bytes but ~100x slower, which a
            # user would otherwise only notice as a slow run.
            log.warning("nemo-dcr: C kernels unavailable (%s); using the PyTorch reference (same bytes, "
                        "~100x slower)", build_error)
        _tried = True
    return _lib


def backend() -> str:
    """Which codec backend runs the ``classes`` coding: ``"native"`` (the C kernel) or
    ``"reference"`` (the PyTorch reference; ``build_error`` says why)."""
    return "native" if lib() is not None else "reference"
