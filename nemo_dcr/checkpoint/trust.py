"""What a checkpoint pulled with trusted keys remembers between commands: the namespace it
follows and the newest HEAD it verified (version and manifest digest).

A ``Verifier`` refuses a HEAD older than one it accepted, but a new command starts a new
verifier, which would trust the first HEAD it sees: a store rolled back, or a replayed older
signed HEAD, would then be applied by the next ``nemo-dcr pull``. The record lives with the
receiver (``OUT/.nemo-dcr-trust.json`` in a directory checkpoint, ``.NAME.nemo-dcr-trust.json``
beside a single file), written atomically after each verified pull, and seeds the next
command's verifier. A hidden file: checkpoint readers and writers leave it alone.
"""
from __future__ import annotations

import json
import os

from nemo_dcr.errors import DcrError

NAME = ".nemo-dcr-trust.json"


def record_path(out: str) -> str:
    out = os.path.realpath(out)
    if os.path.isdir(out):
        return os.path.join(out, NAME)
    d, base = os.path.split(out)
    return os.path.join(d, f".{base}{NAME}")


def load(out: str) -> dict | None:
    """The record of ``out`` (None: none yet). A damaged record is an error, not a fresh start:
    a fresh start is what a replay needs."""
    path = record_path(out)
    try:
        with open(path, encoding="utf-8") as f:
            rec = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise DcrError(f"{path}: cannot read the record of the versions {out} verified ({e}); remove it only if "
                       "you trust the store's HEAD as it is now") from None
    if not (isinstance(rec, dict) and isinstance(rec.get("namespace"), str) and isinstance(rec.get("version"), int)
            and isinstance(rec.get("manifest_sha256"), (str, type(None)))):
        raise DcrError(f"{path}: not a record of verified versions; remove it only if you trust the store's HEAD "
                       "as it is now")
    return rec


def seed(verifier, rec: dict | None) -> None:
    """Give ``verifier`` what ``rec`` remembers: its namespace (when the verifier has none) and
    the newest HEAD verified, if of the verifier's namespace."""
    if rec is None:
        return
    if verifier.namespace is None:
        verifier.namespace = rec["namespace"]
    if verifier.namespace == rec["namespace"]:
        verifier.remember(rec["version"], rec["manifest_sha256"])


def save(out: str, verifier) -> None:
    """Record the newest HEAD ``verifier`` accepted (nothing if it accepted none)."""
    from nemo_dcr.util.atomic import output_file
    seen = verifier.seen
    if seen is None or verifier.namespace is None:
        return
    text = json.dumps({"namespace": verifier.namespace, "version": seen[0], "manifest_sha256": seen[1]}, indent=1)
    with output_file(record_path(out)) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())
