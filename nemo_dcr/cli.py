"""The ``nemo-dcr`` command line. Stable interface for files; see README.md."""
from __future__ import annotations

import argparse
import json
import os
import sys

from . import __version__
from .errors import DcrError


def _cmd_diff(a):
    from .files import diff_checkpoints
    from .stats import inspect
    diff_checkpoints(a.base, a.target, a.output, encoding=a.encoding, level=a.level, chunk_elems=a.chunk_elems,
                     workers=a.workers)
    s = inspect(a.output)
    print(f"wrote {a.output}: {s['bytes']:,} bytes, {s['changed']:,} of {s['elements']:,} elements changed "
          f"({100 * s['change_rate']:.4f} %), {s['ratio_to_dense']:.1f}x smaller than dense")


def _cmd_apply(a):
    from .files import apply_checkpoint
    r = apply_checkpoint(a.base, a.delta, a.output, workers=a.workers)
    rep = r.report
    print(f"wrote {r.out}: {r.files} file(s), {rep.elements_changed:,} elements changed in "
          f"{rep.tensors_changed} tensor(s); base and result verified bit-exactly")


def _cmd_inspect(a):
    from .stats import format_text, inspect
    s = inspect(a.delta)
    if a.json:
        print(json.dumps(s, indent=2))
    else:
        print(format_text(s))


def _cmd_demo(a):
    from .demo import run_demo
    run_demo(a.workdir, steps=a.steps)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nemo-dcr", description="Bit-exact delta-compressed weight refit.")
    p.add_argument("--version", action="version", version=f"nemo-dcr {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("diff", help="encode TARGET as a delta against BASE (safetensors file or directory)")
    d.add_argument("base")
    d.add_argument("target")
    d.add_argument("-o", "--output", required=True, help="delta file to write")
    d.add_argument("--encoding", choices=["auto", "xor", "overwrite"], default="auto",
                   help="auto: per chunk, the smaller of xor and overwrite (default)")
    d.add_argument("--level", type=int, default=3, help="zstd level (default 3)")
    d.add_argument("--chunk-elems", type=int, default=1 << 20, help="elements per chunk (bounds memory)")
    d.add_argument("--workers", type=int, default=None, help="encoder threads (default: cores, at most 8)")
    d.set_defaults(func=_cmd_diff)

    ap = sub.add_parser("apply", help="apply DELTA to BASE and write the verified result to OUT atomically")
    ap.add_argument("base")
    ap.add_argument("delta")
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--workers", type=int, default=None)
    ap.set_defaults(func=_cmd_apply)

    i = sub.add_parser("inspect", help="what a delta holds: change rate, bytes by stream and encoding")
    i.add_argument("delta")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=_cmd_inspect)

    m = sub.add_parser("demo", help="train a small model, diff and apply its checkpoints, verify every step")
    m.add_argument("--workdir", default="runs/demo")
    m.add_argument("--steps", type=int, default=6)
    m.set_defaults(func=_cmd_demo)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except DcrError as e:
        print(f"nemo-dcr: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("nemo-dcr: interrupted", file=sys.stderr)
        return 130
    except OSError as e:
        print(f"nemo-dcr: error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # a bug: still one line, the traceback with NEMO_DCR_DEBUG=1
        if os.environ.get("NEMO_DCR_DEBUG"):
            raise
        print(f"nemo-dcr: internal error (please report; NEMO_DCR_DEBUG=1 shows the traceback): "
              f"{type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
