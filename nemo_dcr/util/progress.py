"""Progress on a terminal: a tqdm bar on stderr when it is a TTY, silence otherwise."""
from __future__ import annotations

import sys


class Progress:
    def __init__(self, total: int, desc: str, unit: str = "B", enabled: bool | None = None):
        if enabled is None:
            enabled = sys.stderr.isatty()
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm
                self._bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=True, leave=False, file=sys.stderr)
            except ImportError:  # tqdm is a dependency, but progress must never break work
                self._bar = None

    def update(self, n: int) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class NullProgress(Progress):
    def __init__(self, *a, **k):
        self._bar = None
