"""A wheel of a source tree, installed into a fresh virtual environment with no C compiler on
PATH: what a user's slim image (a rollout engine's container, a CI job) runs. Used by
tests/test_packaging.py and bench/first_call.py (the first-call figures of docs/results.md).

    whl = build_wheel(src, out_dir)
    env = FreshVenv(tmp / "venv", whl)                     # the wheel installed, no compiler
    r = env.run(["-c", "import nemo_dcr"])                 # a subprocess.CompletedProcess
    env.compiled()                                         # did anything call a compiler?

The venv has its own site-packages (the wheel goes there) and reads the running interpreter's
site-packages after it (torch, numpy, zstandard, blake3: installing those again would cost
minutes and test nothing of ours). Nothing of the checkout is importable from it: it runs
outside the checkout, without PYTHONPATH, and an editable install of the checkout in the
running interpreter is not processed there (a path in a ``.pth`` file is added to sys.path;
the ``.pth`` files inside it are not read).

The compiler commands (cc, gcc, clang, c99, and $CC) are stand-ins that record each call in
``compiler-calls`` and fail, so "no compiler needed" is checked, not assumed.
"""
from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMPILERS = ("cc", "gcc", "clang", "c99", "g++", "c++", "x86_64-linux-gnu-gcc", "aarch64-linux-gnu-gcc")
# what a wheel is built from: the project's files, not the checkout's build outputs
SOURCES = ("nemo_dcr", "csrc", "pyproject.toml", "setup.py", "MANIFEST.in", "README.md")


def copy_sources(dst: Path, root: Path = ROOT) -> Path:
    """The files a wheel is built from, copied (a stale build/ or built library in the checkout
    could otherwise hide what a clean build ships)."""
    dst.mkdir(parents=True, exist_ok=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info", "build")
    for name in SOURCES:
        p = root / name
        if p.is_dir():
            shutil.copytree(p, dst / name, ignore=ignore)
        elif p.exists():
            shutil.copy(p, dst / name)
    return dst


def build_wheel(src: Path, out: Path, python: str = sys.executable) -> Path:
    """``pip wheel`` of ``src`` (without build isolation: the build tools of ``python`` are used,
    and nothing is downloaded) -> the wheel's path."""
    r = subprocess.run([python, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(src),
                        "-w", str(out)], capture_output=True, text=True, timeout=900, cwd=str(out.parent))
    if r.returncode != 0:
        raise RuntimeError(f"pip wheel failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    (whl,) = out.glob("nemo_dcr-*.whl")
    return whl


class FreshVenv:
    def __init__(self, path: Path, wheel: Path, python: str = sys.executable):
        self.path = Path(path)
        subprocess.run([python, "-m", "venv", "--without-pip", str(self.path)], check=True, timeout=300)
        self.python = str(self.path / "bin" / "python")
        purelib = subprocess.run([self.python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 capture_output=True, text=True, check=True).stdout.strip()
        deps = [p for p in site.getsitepackages() + [sysconfig.get_paths()["purelib"]] if os.path.isdir(p)]
        Path(purelib, "_running_interpreter_deps.pth").write_text("\n".join(dict.fromkeys(deps)) + "\n")
        # --ignore-installed: the running interpreter's site-packages (read through the .pth) may
        # list this project already (an editable install); pip must neither skip the wheel for it
        # nor uninstall it from there. No PYTHONPATH: a checkout on it would count as installed.
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        r = subprocess.run([python, "-m", "pip", "--python", self.python, "install", "--no-deps", "--ignore-installed",
                            "-q", str(wheel)], capture_output=True, text=True, timeout=600, env=env)
        if r.returncode != 0:
            raise RuntimeError(f"pip install of {wheel.name} failed:\n{r.stderr[-3000:]}")
        self.tools = self.path / "no-compiler"
        self.tools.mkdir()
        self.calls = self.path / "compiler-calls"
        for name in COMPILERS:
            stub = self.tools / name
            stub.write_text(f'#!/bin/sh\necho "{name} $*" >> "{self.calls}"\nexit 1\n')
            stub.chmod(0o755)
        self.cache = self.path / "nemo-dcr-cache"  # $NEMO_DCR_CACHE: empty, like a new container's

    def env(self, compiler: bool = False, **extra) -> dict:
        """No compiler on PATH (only the venv's scripts and the stand-ins; $CC a stand-in too),
        no PYTHONPATH, an empty cache. ``compiler=True``: the system's PATH and $CC instead (the
        "before" figures of bench/first_call.py: a first-use build needs them)."""
        keep = {k: v for k, v in os.environ.items()
                if k not in ("PYTHONPATH", "CC", "NEMO_DCR_NATIVE", "NEMO_DCR_NATIVE_CFLAGS", "NEMO_DCR_CACHE",
                             "VIRTUAL_ENV", "PATH")}
        out = {**keep, "PATH": f"{self.path / 'bin'}:{self.tools}", "CC": str(self.tools / "cc"),
               "NEMO_DCR_CACHE": str(self.cache), "HOME": str(self.path)}
        if compiler:
            out["PATH"] = f"{self.path / 'bin'}:{os.environ.get('PATH', '/usr/bin:/bin')}"
            out.pop("CC")
            if "CC" in os.environ:
                out["CC"] = os.environ["CC"]
        return {**out, **extra}

    def path_has_no_compiler(self) -> bool:
        """Whether every compiler found on this env's PATH is one of the stand-ins."""
        path = self.env()["PATH"]
        return all(shutil.which(c, path=path) in (None, str(self.tools / c)) for c in COMPILERS)

    def run(self, args, timeout: float = 600, compiler: bool = False, **extra) -> subprocess.CompletedProcess:
        """``args`` after the venv's python (``["-c", code]``), or a console script's full path
        as ``args[0]``."""
        cmd = list(args) if os.path.isabs(str(args[0])) else [self.python, *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env=self.env(compiler, **extra), cwd=str(self.path))

    def timed(self, args, **kw) -> tuple[float, subprocess.CompletedProcess]:
        t0 = time.perf_counter()
        r = self.run(args, **kw)
        return time.perf_counter() - t0, r

    def script(self, name: str) -> str:
        return str(self.path / "bin" / name)

    def compiled(self) -> list[str]:
        """The compiler calls made so far (each a line: the command and its arguments)."""
        return self.calls.read_text().splitlines() if self.calls.exists() else []
