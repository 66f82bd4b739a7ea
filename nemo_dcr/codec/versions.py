"""Delta format versions: what each one's digests are (docs/format.md, "Versioning").

Versions 1 and 2 change only what a reader must know to check a delta; their container, header
and chunk codings are the same:

* version 1: tensor digests ``"sha256:"`` (or, earlier, bare BLAKE2b-128), chunk ``pre``/``post``
  BLAKE2b-64;
* version 2: tensor digests ``"blake3:"``, chunk ``pre``/``post`` the first 64 bits of BLAKE3;
* version 3: the same header and chunk codings in a container of segments, each chunk's index
  before the chunk (codec/format.py), and tensor digests ``"sd:"``, sums over elements
  (state/digest.py) that the writer updates from the changed elements alone; chunk
  ``pre``/``post`` as in version 2;
* version 4: version 3 with tensor digests ``"sdn:"``, each tensor's (or region's) share of the
  state digest: keyed by its name and global shape, so a state's tensor digests add up to its
  state digest and a writer sums every element once, not once for each; and a ``removed`` entry
  of a sender that held part of the tensor names that part;
* version 5: version 4 with tensor digests ``"sdb:"``, the same shares under the state digest's
  definition 2 (blocked weights: ~3x cheaper to sum over a whole tensor), whose manifests
  (format 5) hold state digests of definition 2 too.

Tensor digests name their algorithm, so a reader checks any it knows in any version. The
chunk digests carry no name (16 hex digits each, one pair per chunk), so the version says which
they are; a reader of version 1 refuses a version 2 delta as a version it does not know, rather
than report every chunk as a wrong base (and a reader of 1 and 2 refuses version 3 the same way,
a reader of 1 to 3 version 4, a reader of 1 to 4 version 5: its tensor digests it could not check).
``diff(..., format_version=1)`` still writes version 1, for receivers older than version 2.
"""
from __future__ import annotations

from dataclasses import dataclass

from nemo_dcr.errors import DcrError


@dataclass(frozen=True)
class Version:
    number: int
    tensor_digest: str  # the algorithm a writer of this version hashes tensors with (state/digest.py)
    values_digest: str  # the algorithm of every chunk's pre/post image digest

    @property
    def definition(self) -> int:
        """The state digest definition (``statedigest.DEFINITIONS``) of its summed tensor digests
        and of the manifests published with it: its tensor digests' (``state.digest.DEFINITION``;
        1 for a version whose tensor digests are hashes)."""
        from nemo_dcr.state.digest import DEFINITION  # (here: the CLI reads this module without torch)
        return DEFINITION.get(self.tensor_digest, 1)


VERSIONS = {1: Version(1, "sha256", "blake2b"), 2: Version(2, "blake3", "blake3"), 3: Version(3, "sd", "blake3"),
            4: Version(4, "sdn", "blake3"), 5: Version(5, "sdb", "blake3")}
FORMAT_VERSION = 5  # what a writer writes unless asked for another
#: the first version whose ``removed`` entries name the part of the tensor (``shape``, ``region``)
#: their base digest is of, where the sender held a part (docs/format.md, "Tensor entry")
REGION_OF_REMOVED = 4


def version(number: int) -> Version:
    """The version ``number``; ``DcrError`` for one this build does not know (to write)."""
    v = VERSIONS.get(number) if isinstance(number, int) and not isinstance(number, bool) else None
    if v is None:
        raise DcrError(f"format version {number!r} is not supported "
                         f"(this build reads and writes {', '.join(map(str, VERSIONS))})")
    return v
