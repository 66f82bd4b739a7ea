"""Optional dependencies (the package's extras): imported through :func:`require`, so that a
missing one is a one-line error that says what to install, not a traceback."""
from __future__ import annotations

import importlib
from typing import Any

from nemo_dcr.errors import MissingExtraError


def require(module: str, extra: str, what: str | None = None) -> Any:  # a module: its attributes are dynamic
    """Import and return ``module``; if it (or a package above it) is not installed, raise
    :class:`MissingExtraError` (also an ``ImportError``) naming ``pip install "nemo-dcr[<extra>]"``,
    which installs it with its own dependencies. Other errors while importing are not masked."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        top = module.split(".")[0]
        missing = e.name or top
        gone = f"{top} is not installed" if missing.split(".")[0] == top else \
            f"{top} cannot be imported (its dependency {missing} is not installed)"
        raise MissingExtraError(f"{what or top} needs {top}, and {gone}: "
                                f'pip install "nemo-dcr[{extra}]"') from None
