"""The delta container and the chunk codings.

``format`` (container), ``chunk`` (per-chunk codings; their names in the torch-free ``names``),
``positions``, ``planes``, ``ordered``, ``classes`` (the reference that defines the ``classes``
bytes) and ``native`` (the same bytes from the C kernel in ``csrc/``, shipped as package data and
built at first use).
"""
from nemo_dcr.codec.native import backend

__all__ = ["backend"]
