"""The ``nemo-dcr`` command in tests: in-process through ``nemo_dcr.cli.main`` (a subprocess
costs ~3 s of imports per call), and the path of the real console script for the smoke tests."""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass


@dataclass
class CliResult:
    """What a run of the command left: its exit code and what it printed."""
    returncode: int
    stdout: str
    stderr: str


def run_cli(capsys, *args) -> CliResult:
    """``nemo-dcr ARGS`` in this process; ``capsys`` (pytest's fixture) captures its output.
    A usage error (argparse's ``SystemExit``) comes back as its exit code, as from the shell."""
    from nemo_dcr.cli import main
    capsys.readouterr()  # drop what came before: the result holds this command's output only
    try:
        rc = main([str(a) for a in args])
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    out, err = capsys.readouterr()
    return CliResult(rc, out, err)


def console_script() -> str:
    """The installed ``nemo-dcr`` script next to the running interpreter."""
    exe = os.path.join(os.path.dirname(sys.executable), "nemo-dcr")
    assert os.path.exists(exe), "nemo-dcr console script not installed in this environment"
    return exe


def run_scripts(commands: dict, timeout: float = 120) -> dict:
    """``{key: args}`` -> ``{key: CliResult}``: each ``nemo-dcr ARGS`` as a new process through
    the console script, all started at once (a process start is mostly imports: CPU the other
    cores can share)."""
    exe = console_script()
    procs = {k: subprocess.Popen([exe, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k, args in commands.items()}
    results = {}
    try:
        for k, p in procs.items():
            out, err = p.communicate(timeout=timeout)
            results[k] = CliResult(p.returncode, out, err)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return results
