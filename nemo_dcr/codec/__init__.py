"""The delta container and the chunk codings.

``format`` (container), ``chunk`` (per-chunk codings; their names in the torch-free ``names``),
``positions``, ``planes``, ``ordered``, ``classes`` (the reference that defines the ``classes``
bytes) and ``native`` (the same bytes from the C kernels of the top-level ``csrc/``, compiled into the
package when it is built: ``libdcr.so``).
"""
from nemo_dcr.codec.native import backend

__all__ = ["backend"]
