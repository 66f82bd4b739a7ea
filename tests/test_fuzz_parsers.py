"""Fast, deterministic fuzz (hypothesis) of what parses bytes others hand us (issue 14): the
manifest parser, the HEAD parser and signature check, and a real relay fed raw, malformed HTTP
requests over a socket. Only typed errors (ManifestError, SignatureError) and 4xx answers; the
relay stays up. The long, coverage-guided run is bench/fuzz.py (docs/reliability.md)."""
import json
import socket

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcr_testing.relay import RelayProc
from nemo_dcr.errors import DcrError, ManifestError, SignatureError
from nemo_dcr.stores import LocalStore
from nemo_dcr.stores.base import check_key
from nemo_dcr.sync.publisher import Publisher
from nemo_dcr.sync.signing import Signer, Verifier, generate_key
from nemo_dcr.sync.versions import HEAD_KEY, Head, Manifest, canonical_sha256, version_dir

FAST = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
KEY = generate_key()


def published(root, signer):
    store = LocalStore(root)
    pub = Publisher(store, keyframe_every=2, signer=signer)
    s = {"w": torch.arange(32, dtype=torch.float32), "b": torch.ones(4, dtype=torch.bfloat16)}
    heads = []
    for i in range(3):
        s["w"][i] += 1
        pub.publish(s)
        heads.append(store.get(HEAD_KEY))
    manifests = [(k, store.get(k)) for k in store.list("versions/") if k.endswith("manifest.json")]
    return store, manifests, heads


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    _, m1, h1 = published(root / "unsigned", None)
    _, m2, h2 = published(root / "signed", Signer(KEY, "fuzz"))
    return m1 + m2, h1 + h2


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2 ** 70, max_value=2 ** 70) | st.floats(allow_nan=False)
    | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12)
HOSTILE_KEYS = st.sampled_from(["../x", "/etc/passwd", "versions/../HEAD", "a//b", ".hidden/x", "x\x00y",
                                "versions/000000000001/p/../../part-00000.dcr", "HEAD", "", "a\\b"])


def accepted_manifest_is_sane(m: Manifest) -> None:
    d = version_dir(m.version, m.publish_id)
    for p in (*m.parts, *m.keyframe_parts):
        assert check_key(p.key) and p.key.startswith(d + "/"), p.key
    if m.base_manifest is not None:
        assert check_key(m.base_manifest) and m.base_version < m.version


def pick(d: dict, where: str) -> dict:
    """The object a change goes to: the manifest, its first part, or its signature."""
    if where == "signature" and isinstance(d.get("signature"), dict):
        return d["signature"]
    if where == "part":
        for parts in (d.get("parts"), d.get("keyframe_parts")):
            if isinstance(parts, list) and parts and isinstance(parts[0], dict):
                return parts[0]
    return d


def reseal(d: dict) -> bytes:
    d = dict(d)
    d.pop("checksum", None)
    try:
        d["checksum"] = canonical_sha256(d)
    except ValueError:
        pass  # NaN: cannot be canonical; the parser meets it without a valid checksum
    return json.dumps(d).encode()


@FAST
@given(data=st.binary(max_size=3000))
def test_manifest_parser_on_arbitrary_bytes(data):
    try:
        m = Manifest.from_bytes(data)
    except ManifestError:
        return
    accepted_manifest_is_sane(m)


def test_manifest_parser_on_real_manifests_with_fields_replaced(real):
    manifests, _ = real
    verifier = Verifier([KEY.public_key()])

    @FAST
    @given(i=st.integers(0, len(manifests) - 1), changes=st.lists(
        st.tuples(st.sampled_from(["top", "part", "signature"]), st.text(max_size=16), JSON | HOSTILE_KEYS),
        min_size=1, max_size=3))
    def run(i, changes):
        key, raw = manifests[i]
        d = json.loads(raw)
        for where, name, value in changes:
            target = pick(d, where)
            keys = sorted(target)
            target[name if name in target or not keys else keys[len(name) % len(keys)]] = value
        try:
            m = Manifest.from_bytes(reseal(d), key)
        except ManifestError:
            return
        accepted_manifest_is_sane(m)
        try:
            verifier.check_manifest(m)
        except SignatureError:
            return
        # verified: then nothing the signature covers was changed
        assert m.sha256 == Manifest.from_bytes(raw, key).sha256

    run()


def test_head_parser_and_signature_check(real):
    _, heads = real

    @FAST
    @given(i=st.integers(0, len(heads) - 1), field=st.sampled_from(
        ["version", "manifest", "keyframe_version", "keyframe_manifest", "manifest_sha256", "keyframe_sha256",
         "format", "signature", "extra"]), value=JSON | HOSTILE_KEYS, raw=st.booleans(), junk=st.binary(max_size=200))
    def run(i, field, value, raw, junk):
        data = junk if raw else None
        if data is None:
            d = json.loads(heads[i])
            d[field] = value
            data = reseal(d)
        try:
            h = Head.from_bytes(data)
        except ManifestError:
            return
        assert check_key(h.manifest) and h.keyframe_version <= h.version
        try:
            Verifier([KEY.public_key()]).check_head(h)
        except SignatureError:
            return
        assert h.to_bytes() == Head.from_bytes(heads[i]).to_bytes()  # verified: unchanged

    run()


# ----------------------------------------------------------------------------- the relay

def exchange(port: int, request: bytes, whole: bool = False) -> bytes:
    """Send ``request`` and read the answer's head (``whole``: everything until the relay closes).
    A request the relay is still waiting on (an announced body never sent) gets our side closed
    after 2 s, and whatever the relay then says."""
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        s.sendall(request)
        out = b""
        try:
            while whole or b"\r\n\r\n" not in out:
                b = s.recv(65536)
                if not b:
                    return out
                out += b
        except TimeoutError:
            if out:
                return out
            s.shutdown(socket.SHUT_WR)
            s.settimeout(20)
            try:
                return s.recv(65536)
            except ConnectionError:
                return b""
        return out


TOKEN_CHARS = st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=30)
PATH = st.lists(st.one_of(
    st.sampled_from(["ns", "HEAD", ".list", ".stats", "versions", "..", ".", "%2e%2e", "%2F", "%00", "%c0%ae",
                     "%ZZ", "", "run1", "ok", "\u00e9", "a\\b", "*", "%", "?", "#", ";"]),
    st.text(st.characters(min_codepoint=33, max_codepoint=126, blacklist_characters=" "), max_size=8)),
    max_size=6).map(lambda parts: "/" + "/".join(parts))
QUERY = st.sampled_from(["", "?prefix=", "?prefix=../", "?prefix=%00", "?newer_than=x", "?newer_than=-1&wait=0",
                         "?wait=nan", "?wait=-5", "?wait=0", "?newer_than=99999999999999999999&wait=0",
                         "?%zz=1", "?prefix=versions/"])
HEADER = st.sampled_from(["Range: bytes=0-", "Range: bytes=5-2", "Range: bytes=-5", "Range: bytes=99999999999-",
                          "Range: items=0-1", "Content-Length: 5", "Content-Length: -1", "Transfer-Encoding: chunked",
                          "Authorization: Bearer x", "Host:", "X: \x01", "Connection: keep-alive",
                          "Expect: 100-continue"])
METHOD = st.sampled_from(["GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "BREW", "G\x00T", "", "get"])


def test_relay_answers_malformed_requests_with_4xx_and_stays_up(tmp_path):
    store = LocalStore(tmp_path / "s")
    Publisher(store, signer=None).publish({"w": torch.ones(8)})
    store.put("run1/ok", b"fine")
    (tmp_path / "secret").write_bytes(b"SECRET")
    r = RelayProc(store.url, "--prefix", "ns")
    statuses = {}
    try:
        @FAST
        @given(method=METHOD, path=PATH, query=QUERY, headers=st.lists(HEADER | TOKEN_CHARS, max_size=3),
               version=st.sampled_from(["HTTP/1.1", "HTTP/1.0", "HTTP/9.9", "", "FOO"]),
               raw=st.binary(min_size=1, max_size=120).filter(lambda b: b.strip(b"\r\n")),
               use_raw=st.integers(0, 9))
        def run(method, path, query, headers, version, raw, use_raw):
            if use_raw == 0:
                req = raw + b"\r\n\r\n"  # bytes, not HTTP at all
            else:
                text = f"{method} {path}{query} {version}\r\nHost: x\r\nConnection: close\r\n" + \
                       "".join(f"{h}\r\n" for h in headers) + "\r\n"
                req = text.encode("utf-8", "surrogateescape")
            answer = exchange(r.port, req)
            assert r.proc.poll() is None, "the relay died"
            assert b"SECRET" not in answer
            if not answer:
                return  # the connection closed without an answer (an incomplete request): allowed
            line = answer.split(b"\r\n", 1)[0].split(b" ")
            assert line[0].startswith(b"HTTP/1."), answer[:200]
            status = int(line[1])
            statuses[status] = statuses.get(status, 0) + 1
            assert status < 500, (req, answer[:300])

        run()
        # still serving, correctly
        assert exchange(r.port, b"GET /ns/HEAD HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                        whole=True).endswith(b"\r\n\r\n" + store.get("HEAD"))
    finally:
        r.stop()
    assert sum(v for k, v in statuses.items() if 400 <= k < 500) > 50, statuses  # the fuzz reached the checks
    assert r.proc.returncode == 0


def test_typed_errors_only_from_the_verified_store(tmp_path, real):
    """A store whose HEAD and manifests are arbitrary bytes: a verified follower's reads raise
    DcrErrors only."""
    from nemo_dcr.sync.signing import VerifiedStore
    store = LocalStore(tmp_path / "s")
    manifests, heads = real
    vs = VerifiedStore(store, Verifier([KEY.public_key()]))

    @FAST
    @given(data=st.binary(max_size=400) | st.sampled_from([b for _, b in manifests] + heads),
           which=st.sampled_from(["HEAD", manifests[0][0]]))
    def run(data, which):
        store.put(which, data)
        try:
            vs.get(which)
        except DcrError:
            pass

    run()
