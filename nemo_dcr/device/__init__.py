"""The device path (issue 12): diff-and-compact and apply passes that run where the tensors live.

* ``diff.diff_`` (trainer): one fused pass over the live shard and the last published snapshot
  finds the changed elements on raw bits and compacts positions, pre-image and new bits; for the
  ``classes`` coding a second pass over the snapshot alone places each change in its base
  exponent class and ranks it within the class; the snapshot is then updated in place. Only the
  compact change stream crosses to the host, where ``encode.encode_changes_chunks`` codes it
  with the reference coders (``codec/classes.encode_ranked``, ``codec/chunk.encode_changes``):
  the same bytes as ``codec/chunk.encode_chunk`` for every encoding and dtype.
* ``apply.apply_`` (receiver): checks every pre-image, writes nothing if one differs, then
  scatters the new bits in place; ``apply.digest_change`` is the O(changes) state-digest update.

Kernels are Triton (``kernels.py``): they run on CUDA, and on CPU tensors under
``TRITON_INTERPRET=1``, which is how the tests check their logic on machines without a GPU.
Triton is optional (the ``gpu`` extra); importing ``nemo_dcr.device`` does not need it, calling
a kernel does (``available()`` says whether it can).
"""
from nemo_dcr.device.kernels import available

__all__ = ["available"]
