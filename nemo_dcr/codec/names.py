"""The names of the chunk codings and of the ``encoding`` choices, without torch.

Defined here, not in ``chunk.py`` (which imports torch), so that the command line can offer them
as choices while ``nemo-dcr --help`` and ``nemo-dcr relay`` stay free of torch; ``chunk.py``
imports them from here.
"""
from __future__ import annotations

OVERWRITE, XOR, ADD, CLASSES = "overwrite", "xor", "add", "classes"
ENCODINGS = (OVERWRITE, XOR, ADD, CLASSES)  # the codings a chunk's header names
AUTO = "auto"  # mixed: per chunk, the smallest of them (see chunk.encode_chunk)
PORTABLE = "portable"  # mixed without codings that need the whole base chunk (receivers sharded differently)
CHOICES = (AUTO, PORTABLE, OVERWRITE, XOR, ADD, CLASSES)  # what ``encoding=`` accepts
#: zstd level of the byte-plane streams. 1, not 3: on BF16 weights level 1 compresses a keyframe's
#: exponent plane better (37 % vs 42 % of its bytes) and 2.5x faster, and deltas come out within
#: 2 % either way (`classes` chunks use no zstd). Decoders do not care which level wrote a stream.
DEFAULT_LEVEL = 1
#: elements per delta chunk (bounds encode/apply scratch). 4Mi, not 1Mi: each chunk costs ~0.1-0.2
#: ms of fixed work on either side (its call into the C kernels, its scratch, its header entry and
#: class table, its pre-image check and digest call), which at 1Mi was a third of a delta's encode
#: and apply. 64M BF16 at 1 %: encode 39-43 -> 29-37 ms, apply 27-32 -> 20-24 ms, 1.2 % fewer bytes
#: (docs/results.md, issue 25's sixth turn). A keyframe's chunks stay smaller: KEYFRAME_CHUNK
DEFAULT_CHUNK = 1 << 22
#: elements per chunk of a keyframe (a tensor sent whole), at most: 1Mi. Its chunks are dense
#: (byte planes, zstd), so a chunk's fixed work is small beside its bytes, while each chunk in
#: flight holds several copies of them: at 4Mi the publisher held 1.90x a 0.25 GiB model beyond
#: the caller's tensors (1.26x at 1Mi), and a keyframe sync kept more (bench/memory.py)
KEYFRAME_CHUNK = 1 << 20

__all__ = ["OVERWRITE", "XOR", "ADD", "CLASSES", "ENCODINGS", "AUTO", "PORTABLE", "CHOICES", "DEFAULT_LEVEL",
           "DEFAULT_CHUNK", "KEYFRAME_CHUNK"]
