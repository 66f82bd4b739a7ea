"""The ``nemo-dcr`` command line (``main``) and the demo job: the top layer, which may use every other."""
from nemo_dcr.cli.main import main

__all__ = ["main"]
