"""Old module paths keep importing: ``nemo_dcr.publisher``, ``nemo_dcr.callbacks.rollout``, ...

The package was flat until 0.1; user code, YAML ``class_path``s and vLLM's
``worker_extension_cls`` strings name the old paths. A finder on ``sys.meta_path`` answers an
old name with the module at its new home (the same module object, so classes and
``isinstance`` checks are shared), without importing anything until the old name is asked for.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

# old name under nemo_dcr -> new name under nemo_dcr; a package entry maps its submodules too
MOVED = {
    "callbacks": "integrations",
    "format": "codec.format", "chunk": "codec.chunk", "positions": "codec.positions",
    "planes": "codec.planes", "ordered": "codec.ordered", "classes": "codec.classes",
    "native": "codec.native",
    "dtypes": "state.dtypes", "flat": "state.flat", "index_map": "state.index_map",
    "digest": "state.digest", "statedigest": "state.statedigest",
    "stats": "delta.stats",
    "parallel": "util.parallel", "progress": "util.progress",
    "versions": "sync.versions", "publisher": "sync.publisher", "follower": "sync.follower",
    "retention": "sync.retention", "distributed": "sync.group",
    "safetensors_io": "checkpoint.safetensors_io", "files": "checkpoint.files",
    "checkpoint_sync": "checkpoint.sync",
    "demo": "cli.demo",
}


def new_name(fullname: str) -> str | None:
    """The module an old ``nemo_dcr.*`` name now lives at, or None when it did not move."""
    if not fullname.startswith("nemo_dcr."):
        return None
    rest = fullname[len("nemo_dcr."):]
    head, dot, tail = rest.partition(".")
    if head not in MOVED:
        return None
    return f"nemo_dcr.{MOVED[head]}{dot}{tail}"


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        target_name = new_name(fullname)
        if target_name is None:
            return None
        return importlib.util.spec_from_loader(fullname, self, is_package=False)

    def create_module(self, spec):
        target = new_name(spec.name)
        if target is None:  # find_spec made a spec only for a name that has moved
            raise ImportError(f"{spec.name} is not a moved module")
        module = importlib.import_module(target)
        sys.modules[spec.name] = module
        return module

    def exec_module(self, module):  # already executed under its new name
        pass


def install() -> None:
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        # First: the path finder would otherwise load a moved package's files a second time under
        # the old name (two copies of every class).
        sys.meta_path.insert(0, _Alias())
