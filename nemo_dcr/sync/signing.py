"""Signed versions: the publisher signs every manifest and HEAD with Ed25519; a follower that
trusts its public key applies nothing unsigned, wrongly signed, foreign or replayed.

    key = generate_key()                                   # or: nemo-dcr keygen run.key
    pub = Publisher(store, signer=Signer(key, "run-42"))
    f = Follower(store, tensors, verifier=Verifier([key.public_key()], namespace="run-42"))

What a signature binds (``message``): the kind of object (manifest or HEAD), the *namespace* (the
run the publisher signs for), the version number, the parent (a manifest's base manifest digest;
HEAD's manifest digest) and the sha256 of the object's canonical body. Every key a manifest names
and every part's sha256 are in that body, and HEAD and each manifest record the digest of the
manifest they lead to, so one verified HEAD and the manifests on the way authenticate every byte
a follower applies. The signature travels inside the object (``"signature": {"alg", "key",
"namespace", "sig"}``), so HEAD and its signature change together in one atomic write.

A follower with a :class:`Verifier` reads the store through :class:`VerifiedStore`: HEAD and each
manifest are checked as they are read, before anything else is fetched, and refused with a typed
error (:class:`~nemo_dcr.errors.SignatureError`): unsigned (``UnsignedError``), signed by a key not
in the trusted set, altered after signing, signed for another namespace, or -- HEAD only -- an
older version than one this verifier already accepted, or a different manifest for the version
it accepted (``ReplayError``: a store rolled back, or replayed from an older copy). A verifier
without a configured namespace pins the first namespace it verifies.

Keys: private keys are PKCS#8 PEM (what ``nemo-dcr keygen`` and ``openssl genpkey -algorithm
ed25519`` write) or ``ed25519-seed:<base64 of the 32-byte seed>``; public keys are
``ed25519:<base64 of the 32 raw bytes>`` or PEM, any number to a file (one a line, ``#``
comments). From the environment: ``NEMO_DCR_SIGNING_KEY`` (the key itself) or
``NEMO_DCR_SIGNING_KEY_FILE``; ``NEMO_DCR_TRUSTED_KEYS`` (keys, separated by spaces or commas) and
``NEMO_DCR_TRUSTED_KEYS_FILE`` (files, separated by ``os.pathsep``); ``NEMO_DCR_NAMESPACE``.
Rotation: sign with the new key, let followers trust both, drop the old one once retention has
removed every version it signed (docs/user-guide.md, "Signed versions").
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import os
import re
import threading
from collections.abc import Iterable, Iterator

from nemo_dcr.errors import ReplayError, SignatureError, UnsignedError
from nemo_dcr.stores.base import Store
from nemo_dcr.stores.http import wait_head, write_stream_to_file
from nemo_dcr.stores.passthrough import PassThroughStore
from nemo_dcr.sync.versions import HEAD_KEY, Head, Manifest, canonical_sha256, is_manifest_key

__all__ = ["Signer", "Verifier", "VerifiedStore", "generate_key", "public_key_text", "private_key_pem",
           "key_id", "load_private_key", "load_public_keys", "read_private_key_file", "read_public_keys_file",
           "resolve_signer", "verifying", "message", "chain_verifier", "holds_signed_versions",
           "SIGNING_KEY_ENV", "SIGNING_KEY_FILE_ENV", "TRUSTED_KEYS_ENV", "TRUSTED_KEYS_FILE_ENV", "NAMESPACE_ENV"]

SIGNING_KEY_ENV = "NEMO_DCR_SIGNING_KEY"
SIGNING_KEY_FILE_ENV = "NEMO_DCR_SIGNING_KEY_FILE"
TRUSTED_KEYS_ENV = "NEMO_DCR_TRUSTED_KEYS"
TRUSTED_KEYS_FILE_ENV = "NEMO_DCR_TRUSTED_KEYS_FILE"
NAMESPACE_ENV = "NEMO_DCR_NAMESPACE"
ALG = "ed25519"
DOMAIN = b"nemo-dcr signed version 1\n"  # a signature over these bytes means nothing anywhere else
_NAMESPACE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,199}")
_PUBLIC_PREFIX, _SEED_PREFIX = "ed25519:", "ed25519-seed:"


def _ed25519():
    from nemo_dcr.util.extras import require
    return require("cryptography.hazmat.primitives.asymmetric.ed25519", "sign", "signed versions")


def _serialization():
    from cryptography.hazmat.primitives import serialization
    return serialization


# ----------------------------------------------------------------------------- keys

def generate_key():
    """A new Ed25519 private key."""
    return _ed25519().Ed25519PrivateKey.generate()


def _raw_public(pub) -> bytes:
    s = _serialization()
    if isinstance(pub, _ed25519().Ed25519PrivateKey):
        pub = pub.public_key()
    return pub.public_bytes(s.Encoding.Raw, s.PublicFormat.Raw)


def key_id(pub) -> str:
    """A public key's (or a private key's public half's) short name: the first 16 hex digits of
    the sha256 of its raw bytes."""
    return hashlib.sha256(_raw_public(pub)).hexdigest()[:16]


def public_key_text(pub) -> str:
    """``ed25519:<base64>``: one line, for an environment variable or a keys file."""
    return _PUBLIC_PREFIX + base64.b64encode(_raw_public(pub)).decode()


def private_key_pem(key) -> bytes:
    s = _serialization()
    return key.private_bytes(s.Encoding.PEM, s.PrivateFormat.PKCS8, s.NoEncryption())


def load_private_key(text, where: str = "the signing key"):
    """A private key from PEM text or ``ed25519-seed:<base64>``. Errors name ``where`` only,
    never the key's bytes."""
    ed = _ed25519()
    t = text.decode("ascii", "replace") if isinstance(text, (bytes, bytearray)) else str(text)
    t = t.strip()
    try:
        if t.startswith(_SEED_PREFIX):
            seed = base64.b64decode(t[len(_SEED_PREFIX):], validate=True)
            return ed.Ed25519PrivateKey.from_private_bytes(seed)
        key = _serialization().load_pem_private_key(t.encode(), password=None)
    except (ValueError, TypeError, binascii.Error):
        raise SignatureError(f"{where} is not an unencrypted Ed25519 private key (PKCS#8 PEM, as nemo-dcr "
                             f"keygen writes, or {_SEED_PREFIX}<base64 seed>)") from None
    if not isinstance(key, ed.Ed25519PrivateKey):
        raise SignatureError(f"{where} is a {type(key).__name__}, not an Ed25519 key")
    return key


def load_public_keys(text, where: str = "the trusted keys") -> list:
    """Every public key in ``text``: ``ed25519:<base64>`` tokens (separated by spaces, commas or
    newlines; ``#`` starts a comment) and PEM blocks."""
    ed = _ed25519()
    t = text.decode("ascii", "replace") if isinstance(text, (bytes, bytearray)) else str(text)
    keys = []
    for block in re.findall(r"-----BEGIN PUBLIC KEY-----.*?-----END PUBLIC KEY-----", t, re.S):
        try:
            k = _serialization().load_pem_public_key(block.encode())
        except ValueError:
            raise SignatureError(f"{where}: a PEM block is not a public key") from None
        if not isinstance(k, ed.Ed25519PublicKey):
            raise SignatureError(f"{where}: a PEM public key is a {type(k).__name__}, not Ed25519")
        keys.append(k)
    t = re.sub(r"-----BEGIN PUBLIC KEY-----.*?-----END PUBLIC KEY-----", " ", t, flags=re.S)
    for line in t.splitlines():
        for tok in re.split(r"[\s,]+", line.split("#", 1)[0]):
            if not tok:
                continue
            try:
                if not tok.startswith(_PUBLIC_PREFIX):
                    raise ValueError
                keys.append(ed.Ed25519PublicKey.from_public_bytes(
                    base64.b64decode(tok[len(_PUBLIC_PREFIX):], validate=True)))
            except (ValueError, binascii.Error):
                raise SignatureError(f"{where}: {tok[:24]!r}... is not a public key "
                                     f"({_PUBLIC_PREFIX}<base64 of 32 bytes>, or PEM)") from None
    return keys


def _read(path: str, what: str, private: bool = False) -> str:
    from nemo_dcr.util.keyfiles import KeyFileError, read_key_file
    try:
        return read_key_file(path, what, private=private)
    except KeyFileError as e:
        raise SignatureError(str(e)) from None


def read_private_key_file(path) -> object:
    """The signing key in ``path``: a regular file only its owner can read (as ssh wants)."""
    path = os.fspath(path)
    return load_private_key(_read(path, "signing key", private=True), f"the signing key file {path}")


def read_public_keys_file(path) -> list:
    path = os.fspath(path)
    keys = load_public_keys(_read(path, "trusted keys"), f"the trusted keys file {path}")
    if not keys:
        raise SignatureError(f"the trusted keys file {path} holds no key")
    return keys


def _check_namespace(namespace) -> str:
    if not isinstance(namespace, str) or not _NAMESPACE.fullmatch(namespace):
        raise SignatureError(f"namespace {namespace!r}: 1 to 200 characters of letters, digits and ._:/@+- "
                             "(the run the versions belong to)")
    return namespace


# ----------------------------------------------------------------------------- what is signed

def _subject(obj) -> tuple[str, int, str | None]:
    """(kind, version, parent) of a manifest or HEAD."""
    if isinstance(obj, Manifest):
        return "manifest", obj.version, obj.base_sha256
    if isinstance(obj, Head):
        return "head", obj.version, obj.manifest_sha256
    raise TypeError(f"cannot sign a {type(obj).__name__}")


def message(obj, namespace: str) -> bytes:
    """The bytes a signature of ``obj`` (a Manifest or Head) covers: kind, namespace, version,
    parent and the digest of its canonical body (every field but the signature)."""
    kind, version, parent = _subject(obj)
    return DOMAIN + canonical_sha256({"kind": kind, "namespace": namespace, "version": version, "parent": parent,
                                      "body": canonical_sha256(obj.fields(signed=False))}).encode()


# ----------------------------------------------------------------------------- signer

class Signer:
    """Signs manifests and HEADs for one namespace with one private key."""

    def __init__(self, key, namespace: str):
        if not isinstance(key, _ed25519().Ed25519PrivateKey):
            raise SignatureError(f"a Signer needs an Ed25519 private key, not {type(key).__name__}")
        self._key = key
        self.namespace = _check_namespace(namespace)
        self.public_key = key.public_key()
        self.key_id = key_id(self.public_key)

    @classmethod
    def from_file(cls, path, namespace: str) -> Signer:
        return cls(read_private_key_file(path), namespace)

    @classmethod
    def from_env(cls, namespace: str | None = None) -> Signer | None:
        """From ``NEMO_DCR_SIGNING_KEY`` or ``NEMO_DCR_SIGNING_KEY_FILE`` (None when neither is
        set), for ``namespace`` or ``NEMO_DCR_NAMESPACE``."""
        if os.environ.get(SIGNING_KEY_ENV):
            key = load_private_key(os.environ[SIGNING_KEY_ENV], f"${SIGNING_KEY_ENV}")
        elif os.environ.get(SIGNING_KEY_FILE_ENV):
            key = read_private_key_file(os.environ[SIGNING_KEY_FILE_ENV])
        else:
            return None
        namespace = namespace or os.environ.get(NAMESPACE_ENV)
        if not namespace:
            raise SignatureError(f"a signing key is set but no namespace: set ${NAMESPACE_ENV} (or --namespace) "
                                 "to the run the versions belong to")
        return cls(key, namespace)

    def signature(self, obj) -> dict:
        """The ``signature`` field for ``obj`` (a Manifest or Head, without one yet)."""
        sig = self._key.sign(message(obj, self.namespace))
        return {"alg": ALG, "key": self.key_id, "namespace": self.namespace, "sig": base64.b64encode(sig).decode()}

    def sign(self, obj) -> None:
        """Set ``obj.signature`` (in place: the object's identity, its sha256, includes it)."""
        obj.signature = None
        obj.signature = self.signature(obj)

    def check_continues(self, head: Head | None) -> None:
        """Before anything is written: the chain this publish extends must be this namespace's
        (a publisher pointed at another run's store would otherwise sign on top of it)."""
        sig = head.signature if head is not None else None
        if sig is not None and sig.get("namespace") != self.namespace:
            raise SignatureError(f"the store's versions are signed for namespace {sig.get('namespace')!r}; this "
                                 f"publisher signs for {self.namespace!r}: wrong store, or wrong namespace")

    def __repr__(self) -> str:  # never the key itself
        return f"Signer(key {self.key_id}, namespace {self.namespace!r})"


def chain_verifier(signer: Signer | None, trusted_keys=()) -> Verifier | None:
    """What a publisher checks the chain it extends with: its own public key, ``trusted_keys``
    (a key rotation's old key) and the environment's trusted keys, for its namespace (None
    without a signer)."""
    if signer is None:
        return None
    env = Verifier.from_env(signer.namespace)
    keys = [signer.public_key, *trusted_keys, *(env.keys.values() if env is not None else ())]
    return Verifier(keys, namespace=signer.namespace)


def holds_signed_versions(store: Store, head: Head) -> str | None:
    """Whether the chain at ``head`` holds signed versions, said as a reason (None: it does
    not, as far as HEAD, its manifest and that one's base show; a manifest that cannot be read
    says nothing)."""
    from nemo_dcr.errors import DcrError
    from nemo_dcr.sync.versions import head_manifest, read_manifest

    def signed(sig, what):
        return f"{what} is signed (key {sig.get('key')!r}, namespace {sig.get('namespace')!r})" \
            if isinstance(sig, dict) else f"{what} is signed"

    if head.signature is not None:
        return signed(head.signature, f"the store's HEAD (version {head.version})")
    try:
        m = head_manifest(store, head)
        if m.signature is not None:
            return signed(m.signature, f"the manifest of version {m.version}")
        if m.base_manifest is not None:
            b = read_manifest(store, m.base_manifest, m.base_sha256)
            if b.signature is not None:
                return signed(b.signature, f"version {b.version}, below the unsigned HEAD (version {head.version}),")
    except DcrError:
        return None
    return None


def resolve_signer(signer) -> Signer | None:
    """``"env"``: :meth:`Signer.from_env`; None: no signing; a Signer: itself."""
    if isinstance(signer, str) and signer == "env":
        return Signer.from_env()
    if signer is None or isinstance(signer, Signer):
        return signer
    raise SignatureError(f"signer must be a Signer, None or 'env', not {type(signer).__name__}")


# ----------------------------------------------------------------------------- verifier

class Verifier:
    """Checks signatures against a set of trusted public keys (several during a rotation), for
    one namespace (given, or pinned by the first object verified), and remembers the newest HEAD
    it accepted so that an older one is refused."""

    def __init__(self, keys: Iterable, namespace: str | None = None):
        ed = _ed25519()
        self.keys = {}
        for k in keys:
            if isinstance(k, ed.Ed25519PrivateKey):
                k = k.public_key()
            if not isinstance(k, ed.Ed25519PublicKey):
                raise SignatureError(f"a trusted key must be an Ed25519 public key, not {type(k).__name__}")
            self.keys[key_id(k)] = k
        if not self.keys:
            raise SignatureError("a Verifier needs at least one trusted public key")
        self.namespace = _check_namespace(namespace) if namespace is not None else None
        self._seen: tuple[int, str | None] | None = None  # newest HEAD accepted: (version, manifest digest)
        self._lock = threading.Lock()

    @classmethod
    def from_sources(cls, sources: Iterable[str], namespace: str | None = None) -> Verifier:
        """Keys from a list of files or ``ed25519:...`` key texts (the CLI's ``--trusted-key``)."""
        keys = []
        for s in sources:
            keys += load_public_keys(s, "--trusted-key") if s.strip().startswith(_PUBLIC_PREFIX) \
                else read_public_keys_file(s)
        return cls(keys, namespace)

    @classmethod
    def from_env(cls, namespace: str | None = None) -> Verifier | None:
        """From ``NEMO_DCR_TRUSTED_KEYS`` / ``NEMO_DCR_TRUSTED_KEYS_FILE`` (None when neither is
        set), for ``namespace`` or ``NEMO_DCR_NAMESPACE`` (unset: pinned on first use)."""
        keys = []
        if os.environ.get(TRUSTED_KEYS_ENV):
            keys += load_public_keys(os.environ[TRUSTED_KEYS_ENV], f"${TRUSTED_KEYS_ENV}")
        for path in filter(None, os.environ.get(TRUSTED_KEYS_FILE_ENV, "").split(os.pathsep)):
            keys += read_public_keys_file(path)
        if not keys:
            return None
        return cls(keys, namespace or os.environ.get(NAMESPACE_ENV) or None)

    def _check(self, obj, what: str) -> None:
        sig = obj.signature
        trusted = ", ".join(sorted(self.keys))
        if sig is None:
            raise UnsignedError(f"{what} is not signed; this reader accepts only versions signed by key(s) {trusted}")
        if not isinstance(sig, dict) or sig.get("alg") != ALG or not all(
                isinstance(sig.get(f), str) for f in ("key", "namespace", "sig")):
            raise SignatureError(f"{what}: malformed signature (expected {ALG})")
        pub = self.keys.get(sig["key"])
        if pub is None:
            raise SignatureError(f"{what} is signed by key {sig['key'][:16]!r}, which this reader does not trust "
                                 f"(trusted: {trusted})")
        try:
            raw = base64.b64decode(sig["sig"], validate=True)
            pub.verify(raw, message(obj, sig["namespace"]))
        except (ValueError, binascii.Error, _invalid_signature()):
            raise SignatureError(f"{what}: the signature does not match (altered after signing, or forged)") from None
        want = self.namespace
        if want is not None and sig["namespace"] != want:
            raise SignatureError(f"{what} is signed for namespace {sig['namespace']!r}, not {want!r}: "
                                 "a version of another run")
        if want is None:
            self.namespace = sig["namespace"]  # pinned: every later object must be of this run

    @property
    def seen(self) -> tuple[int, str | None] | None:
        """The newest HEAD accepted: (version, manifest digest), or None."""
        with self._lock:
            return self._seen

    def remember(self, version: int, manifest_sha256: str | None) -> None:
        """Treat HEAD ``version`` (naming the manifest with that digest) as accepted already: a
        receiver's record of what an earlier process verified (checkpoint/trust.py)."""
        with self._lock:
            if self._seen is None or version > self._seen[0]:
                self._seen = (int(version), manifest_sha256)

    def check_manifest(self, m: Manifest) -> None:
        with self._lock:
            self._check(m, f"manifest {m.key}")

    def check_head(self, h: Head, remember: bool = True) -> None:
        with self._lock:
            self._check(h, f"HEAD (version {h.version})")
            seen = self._seen
            if seen is not None and h.version < seen[0]:
                raise ReplayError(f"HEAD names version {h.version}, older than version {seen[0]} already verified "
                                  f"in namespace {self.namespace!r}: a rolled-back or replayed store")
            if seen is not None and h.version == seen[0] and h.manifest_sha256 != seen[1]:
                raise ReplayError(f"HEAD names another manifest for version {h.version} than the one already "
                                  f"verified in namespace {self.namespace!r}: the history was rewritten")
            if remember:
                self._seen = (h.version, h.manifest_sha256)

    def wrap(self, store: Store) -> VerifiedStore:
        return VerifiedStore(store, self)

    def __repr__(self) -> str:
        return f"Verifier(keys {sorted(self.keys)}, namespace {self.namespace!r})"


def _invalid_signature():
    from cryptography.exceptions import InvalidSignature
    return InvalidSignature


def verifying(store: Store, verifier="env") -> Store:
    """``store`` read through ``verifier`` (``"env"``: :meth:`Verifier.from_env`; None: not
    verified). A store already verified is returned as it is unless another Verifier is given."""
    if isinstance(verifier, str) and verifier == "env":
        verifier = None if isinstance(store, VerifiedStore) else Verifier.from_env()
    if verifier is None or (isinstance(store, VerifiedStore) and store.verifier is verifier):
        return store
    if not isinstance(verifier, Verifier):
        raise SignatureError(f"verifier must be a Verifier, None or 'env', not {type(verifier).__name__}")
    return VerifiedStore(store, verifier)


class VerifiedStore(PassThroughStore):
    """A store whose HEAD and manifests are checked by a :class:`Verifier` as they are read (in
    every way of reading them); every other object, and every write, passes through."""

    def __init__(self, inner: Store, verifier: Verifier):
        super().__init__(inner)
        self.verifier = verifier

    def _checked(self, key: str, data: bytes) -> bytes:
        if key == HEAD_KEY:
            h = Head.from_bytes(data)
            self.verifier.check_head(h)
            newest = h.newest_manifest  # format 3 carries the manifest: checked as if read on its own
            if newest is not None:
                self.verifier.check_manifest(newest)
        elif is_manifest_key(key):
            self.verifier.check_manifest(Manifest.from_bytes(data, key))
        return data

    @staticmethod
    def _signed(key: str) -> bool:
        return key == HEAD_KEY or is_manifest_key(key)

    # -- reads
    def get(self, key: str) -> bytes:
        return self._checked(key, self.inner.get(key))

    def get_with_tag(self, key: str) -> tuple[bytes, str]:
        data, tag = self.inner.get_with_tag(key)
        return self._checked(key, data), tag

    def get_if_changed(self, key: str, tag: str) -> tuple[bytes, str] | None:
        # unchanged: the caller holds the bytes of ``tag``, checked when they were read
        r = self.inner.get_if_changed(key, tag)
        return None if r is None else (self._checked(key, r[0]), r[1])

    def get_stream(self, key: str, offset: int = 0) -> tuple[int, Iterator[bytes]]:
        if not self._signed(key):
            return self.inner.get_stream(key, offset)
        data = self.get(key)
        offset = max(0, int(offset))
        return len(data), iter([data[offset:]] if offset < len(data) else [])

    def get_to_file(self, key: str, path) -> None:
        if not self._signed(key):
            return self.inner.get_to_file(key, path)
        data = self.get(key)
        write_stream_to_file(len(data), iter([data]), path)

    def wait_head(self, newer_than: int | None, wait: float, last: tuple[bytes, str] | None = None):
        res = wait_head(self.inner, newer_than, wait, last)
        if res is not None and res is not last:  # ``last`` was checked when it was read
            self._checked(HEAD_KEY, res[0])
        return res

    # exists, size, list and every write pass through (a follower never writes; a verified store is
    # still a store)

    def __repr__(self) -> str:
        return f"VerifiedStore({self.inner!r}, {self.verifier!r})"

