"""Builds the C kernels of csrc/ into the package when the package is built (issue 24).

``pip wheel .`` makes a platform wheel holding ``nemo_dcr/codec/libdcr.so``; ``pip install -e .``
(``make venv``) builds it into the source tree. The metadata is in pyproject.toml; this file only
adds the compiled part, with setuptools' own ``Extension`` and ``build_ext`` (the convention of
vLLM, flash-attention, apex: sources in a top-level ``csrc/``).

The library is plain C loaded with ctypes (``nemo_dcr/codec/native.py``), not a Python extension
module: it uses no Python API, so one build serves every Python version and the wheel is tagged
``py3-none-<platform>``. One build also serves every x86-64 CPU: the vector code is compiled with
per-function target attributes (AVX-512BW, AVX2) beside the scalar code, and the library picks
by the CPU's features when it is first called (csrc/README.md). Nothing is built at run time.

Where the compiler fails (a platform without gcc/clang-compatible C, an sdist installed without
a compiler), the install still succeeds without the library and the PyTorch reference runs
(same bytes, ~150x slower; it says so once, with how to get the library).

Also imported by ``nemo_dcr/codec/native.py`` in a source checkout (never run there: setuptools
is imported only below ``__main__``), for the one description of the build: ``SOURCES``,
``CFLAGS``, ``source_hash`` and ``compile_command``.
"""
from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CSRC = HERE / "csrc"
SOURCES = ["dcr_classes.c", "dcr_planes.c", "dcr_crc32.c", "dcr_portable.c"]  # compiled, relative to csrc/
# included: part of what the source hash covers
HEADERS = ["dcr_simd_scans.h", "dcr_sd_vec.h", "dcr_avx2_params.h", "dcr_sd_blocked.h"]
CFLAGS = ["-O3", "-std=c99"]          # no -march: the CPU is chosen at run time, not at build time
LIBRARY = "nemo_dcr/codec/libdcr.so"  # where the package looks for it (native.LIBRARY)
EXTENSION = "nemo_dcr.codec.libdcr"


def source_hash(csrc: Path = CSRC) -> str:
    """16 hex digits over the sources and headers; built into the library (``dcr_source_hash()``)
    so a source checkout can tell a library built from other sources."""
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update(name.encode() + b"\0" + (csrc / name).read_bytes())
    return h.hexdigest()[:16]


def compile_command(cc: str, out: str, csrc: Path = CSRC, extra: list[str] | None = None) -> list[str]:
    """The one-step compile-and-link command of a source checkout's build at run time (a variant
    with ``NEMO_DCR_NATIVE_CFLAGS``, or a checkout whose sources changed since its install)."""
    return [cc, *CFLAGS, "-shared", "-fPIC", f'-DDCR_SOURCE_HASH="{source_hash(csrc)}"', *(extra or []),
            "-o", out, *(str(csrc / s) for s in SOURCES)]


def _setup() -> None:
    from setuptools import Extension, setup
    from setuptools.command.build_ext import build_ext
    try:
        from setuptools.command.bdist_wheel import bdist_wheel
    except ImportError:  # setuptools < 70.1
        from wheel.bdist_wheel import bdist_wheel  # type: ignore[no-redef]

    class BuildLibrary(build_ext):
        """setuptools' build_ext, for a library that is loaded with ctypes: named ``libdcr.so``
        (no Python ABI tag), no ``PyInit`` export asked for, and a failed compile reported
        loudly but not fatal (the reference runs instead)."""

        def get_ext_filename(self, fullname):
            # asked with the full name (outputs, in-place copies) and with the last part alone
            # (the build's own output path, joined to the package's directory)
            if fullname == EXTENSION:
                return os.path.join(*LIBRARY.split("/"))
            if fullname == EXTENSION.rsplit(".", 1)[1]:
                return LIBRARY.rsplit("/", 1)[1]
            return super().get_ext_filename(fullname)

        def get_export_symbols(self, ext):
            return ext.export_symbols if ext.name == EXTENSION else super().get_export_symbols(ext)

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as e:  # noqa: BLE001 - setuptools raises several kinds (CompileError, LinkError, ...)
                if os.environ.get("NEMO_DCR_REQUIRE_NATIVE") == "1":
                    raise
                print(f"\n*** nemo-dcr: the C kernels did not build ({type(e).__name__}: {e}); installing without "
                      "them: the PyTorch reference runs instead (same bytes, ~150x slower). Install a C compiler "
                      "and reinstall to get them (NEMO_DCR_REQUIRE_NATIVE=1 makes this an error). ***\n",
                      file=sys.stderr)

    class PlatformWheel(bdist_wheel):
        """A platform wheel that any Python 3 can use: the library does not link libpython."""

        def get_tag(self):
            _, _, plat = super().get_tag()
            return "py3", "none", plat

    lib = Extension(EXTENSION, sources=[os.path.join("csrc", s) for s in SOURCES], depends=[
        os.path.join("csrc", h) for h in HEADERS], extra_compile_args=CFLAGS,
        define_macros=[("DCR_SOURCE_HASH", f'"{source_hash()}"')], export_symbols=[])
    setup(ext_modules=[lib], cmdclass={"build_ext": BuildLibrary, "bdist_wheel": PlatformWheel})


if __name__ == "__main__":
    _setup()
