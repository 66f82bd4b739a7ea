"""What a relay may keep: only manifests the store's recorded identity vouches for.

A manifest that parses and names itself proves nothing: anything on the link to the parent can
re-seal an altered one with a fresh checksum. A relay that kept it would serve it to every child
until it was evicted (each child refusing it, a ``[relay, store]`` fallback list included, since
a refused manifest is not a failure of the source). So a relay keeps a manifest only when its
identity (sha256 of its canonical body, :attr:`~nemo_dcr.sync.versions.Manifest.sha256`) is the
one recorded for its key by

* a HEAD the relay read (``manifest_sha256``, ``keyframe_sha256``), or
* a manifest it already vouched for (``base_sha256`` of its ``base_manifest``),

and, when the relay is given a :class:`~nemo_dcr.sync.signing.Verifier`, only from a HEAD and
manifests whose signatures check. Parts are kept only when they match a vouched manifest.

A HEAD that records another identity for a key than the one vouched before (the earlier HEAD was
forged, or the store's history was rewritten) withdraws it: ``on_withdraw(key)`` lets the relay
drop that version's objects, so the cache always agrees with the newest recorded identity.
Format-1 stores record no identities: their manifests are vouched for by key alone (as before
checksums existed).
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

from nemo_dcr.errors import DcrError
from nemo_dcr.sync.versions import Head, Manifest

__all__ = ["Identities", "ANY"]

log = logging.getLogger("nemo_dcr.relay")

ANY = "*"            # a format-1 record: the key is vouched for, whatever its identity
MAX_RECORDS = 100_000  # keys remembered (~150 B each); the oldest are withdrawn past that


class Identities:
    def __init__(self, verifier=None, on_withdraw: Callable[[str], None] | None = None,
                 max_records: int = MAX_RECORDS):
        self.verifier = verifier
        self.on_withdraw = on_withdraw
        self.max_records = int(max_records)
        self._want: OrderedDict[str, str] = OrderedDict()  # manifest key -> recorded sha256 (or ANY)
        self.withdrawn = 0

    def __len__(self) -> int:
        return len(self._want)

    def expected(self, key: str) -> str | None:
        """The identity recorded for ``key`` (:data:`ANY` for a format-1 record), or None."""
        return self._want.get(key)

    def _record(self, key: str | None, sha256: str | None) -> None:
        if key is None:
            return
        want = sha256 if sha256 is not None else ANY
        old = self._want.get(key)
        self._want[key] = want
        self._want.move_to_end(key)
        if old is not None and old != want:
            self._withdraw(key, f"recorded as {want[:16]}..., earlier as {old[:16]}...")
        while len(self._want) > self.max_records:
            gone, _ = self._want.popitem(last=False)
            self._withdraw(gone, "forgotten (too many records)")

    def _withdraw(self, key: str, why: str) -> None:
        self.withdrawn += 1
        log.warning("relay: %s is no longer vouched for (%s); its version's cached objects are dropped", key, why)
        if self.on_withdraw is not None:
            self.on_withdraw(key)

    def observe_head(self, head: Head) -> None:
        """A HEAD read from the upstream: what it records is vouched for (if it is signed by a
        trusted key, when the relay verifies)."""
        if self.verifier is not None:
            try:
                self.verifier.check_head(head, remember=False)  # an older HEAD is no forgery of its manifests
            except DcrError as e:
                log.warning("relay: HEAD (version %d) vouches for nothing: %s", head.version, e)
                return
        self._record(head.manifest, head.manifest_sha256)
        self._record(head.keyframe_manifest, head.keyframe_sha256)

    def vouch(self, m: Manifest) -> str | None:
        """None if ``m`` is the manifest recorded for its key (then its base link is vouched for
        in turn); else why not."""
        want = self._want.get(m.key)
        if want is None:
            return "no HEAD or vouched manifest records it"
        if want != ANY and m.sha256 != want:
            return f"its identity {m.sha256[:16]}... is not the recorded {want[:16]}..."
        if self.verifier is not None:
            try:
                self.verifier.check_manifest(m)
            except DcrError as e:
                return str(e)
        self._record(m.base_manifest, m.base_sha256)
        return None

    def vouches(self, m: Manifest) -> bool:
        """Whether ``m`` (vouched for earlier) still is: checked again right before its version's
        objects are kept."""
        want = self._want.get(m.key)
        return want is not None and (want == ANY or want == m.sha256)
