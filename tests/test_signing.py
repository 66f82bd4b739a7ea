"""Signed versions (issue 14, Security): a follower that trusts the publisher's Ed25519 key applies
nothing unsigned, wrongly signed, foreign or replayed, and says which with a typed error before a
single part is fetched. Real stores (a local directory and the moto S3 server), real Publisher and
Follower, a real relay process; the attacker edits the store's bytes directly."""
import json

import pytest
import torch

from dcr_testing import assert_state, zeros_like
from dcr_testing.relay import RelayProc
from nemo_dcr.errors import ManifestError, ReplayError, SignatureError, UnsignedError
from nemo_dcr.stores import LocalStore, open_store
from nemo_dcr.sync.follower import Follower
from nemo_dcr.sync.publisher import Publisher
from nemo_dcr.sync.signing import Signer, Verifier, generate_key, private_key_pem, public_key_text, verifying
from nemo_dcr.sync.versions import HEAD_KEY, Head, Manifest, canonical_sha256, read_head

pytest.importorskip("cryptography")

KEY, OTHER = generate_key(), generate_key()


def state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 8, generator=g).bfloat16(), "b": torch.randn(33, generator=g)}


def step(s, i):
    s["w"].view(-1)[i::17] = (s["w"].view(-1)[i::17].float() + 0.25).bfloat16()
    s["b"][i % 33] += 1.0


def publish(store, n, signer, s=None, keyframe_every=3, format_version=3):
    s = state() if s is None else s
    pub = Publisher(store, signer=signer, keyframe_every=keyframe_every, format_version=format_version)
    snaps = []
    for i in range(n):
        if i:
            step(s, i)
        pub.publish(s)
        snaps.append({k: v.clone() for k, v in s.items()})
    return pub, snaps


def reader(store):
    """``store``, recording which keys are read (to show nothing was fetched after a refusal)."""
    from nemo_dcr.stores.base import Store

    class Recorded(Store):
        url = store.url
        keys: list = []

        def _rec(self, k):
            Recorded.keys.append(k)

        def get(self, k):
            self._rec(k)
            return store.get(k)

        def get_with_tag(self, k):
            self._rec(k)
            return store.get_with_tag(k)

        def get_to_file(self, k, p):
            self._rec(k)
            return store.get_to_file(k, p)

        def size(self, k):
            return store.size(k)

        def list(self, prefix=""):
            return store.list(prefix)

        def put(self, *a):
            raise AssertionError("a follower never writes")

        put_file = put_if_absent = put_if_match = delete = put

    Recorded.keys = []
    return Recorded(), Recorded.keys


def rewrite(store, key, edit, sign_with=None):
    """The attacker: edit a manifest's or HEAD's fields and fix its checksum (and, optionally,
    re-sign it with ``sign_with``)."""
    d = json.loads(store.get(key))
    edit(d)
    d.pop("checksum", None)
    if sign_with is not None:
        obj = (Head if key == HEAD_KEY else Manifest)
        parsed = obj(**{k: v for k, v in d.items() if k != "signature"}) if key == HEAD_KEY else \
            Manifest.from_bytes(json.dumps({**d, "checksum": canonical_sha256(d)}).encode())
        sign_with.sign(parsed)
        d["signature"] = parsed.signature
    d["checksum"] = canonical_sha256(d)
    store.put(key, json.dumps(d).encode())


# ----------------------------------------------------------------------------- the good path

def test_signed_versions_are_followed_bit_exactly(store):
    _, snaps = publish(store, 5, Signer(KEY, "run-a"))
    recv = zeros_like(snaps[0])
    f = Follower(store, recv, verifier=Verifier([KEY.public_key()], namespace="run-a"))
    assert f.sync().version == 4
    assert_state(recv, snaps[4])
    head, _ = read_head(store)
    assert head.signature["namespace"] == "run-a" and head.signature["key"] == Signer(KEY, "x").key_id
    # a follower without keys reads a signed store as before
    recv2 = zeros_like(snaps[0])
    assert Follower(store, recv2, verifier=None).sync().version == 4
    assert_state(recv2, snaps[4])


def test_a_follower_with_a_key_verifies_each_step_of_a_long_sync(tmp_path):
    store = LocalStore(tmp_path / "s")
    pub, snaps = publish(store, 2, Signer(KEY, "run-a"), keyframe_every=0)
    recv = zeros_like(snaps[0])
    f = Follower(store, recv, verifier=Verifier([KEY.public_key()]))  # namespace pinned on first use
    assert f.sync().version == 1
    s = {k: v.clone() for k, v in snaps[-1].items()}
    for i in range(2, 6):
        step(s, i)
        pub.publish(s)
    assert f.sync().steps == [("delta", v) for v in range(2, 6)]
    assert_state(recv, s)
    assert f.store.verifier.namespace == "run-a"


# ----------------------------------------------------------------------------- refusals

def refused(store, verifier, err, match, snaps=None):
    """A fresh follower is refused with ``err``; no part was read and its tensors are untouched."""
    s = snaps[0] if snaps else state()
    recv = {k: torch.full_like(v, 3.0) for k, v in s.items()}
    before = {k: v.clone() for k, v in recv.items()}
    rec, keys = reader(store)
    with pytest.raises(err, match=match) as ei:
        Follower(rec, recv, verifier=verifier).sync()
    assert not [k for k in keys if k.endswith(".dcr")], keys  # refused before any part
    assert_state(recv, before)
    return ei.value


def test_unsigned_store_is_refused_by_a_follower_with_keys(store):
    publish(store, 2, None)
    e = refused(store, Verifier([KEY.public_key()]), UnsignedError, "not signed")
    assert Signer(KEY, "x").key_id in str(e)


def test_a_store_signed_by_another_key_is_refused(store):
    publish(store, 2, Signer(OTHER, "run-a"))
    refused(store, Verifier([KEY.public_key()]), SignatureError, "which this reader does not trust")


def test_another_namespace_is_refused(store):
    publish(store, 2, Signer(KEY, "run-b"))
    refused(store, Verifier([KEY.public_key()], namespace="run-a"), SignatureError, "another run")


def test_an_edited_signed_manifest_or_head_is_refused(tmp_path):
    """Format 2: HEAD names the manifest, read from the store on its own."""
    store = LocalStore(tmp_path / "s")
    publish(store, 3, Signer(KEY, "run-a"), format_version=2)
    head, _ = read_head(store)
    ver = Verifier([KEY.public_key()])
    # the manifest's step edited, its checksum and HEAD's digest of it fixed: HEAD's signature breaks
    saved = {k: store.get(k) for k in (HEAD_KEY, head.manifest)}
    rewrite(store, head.manifest, lambda d: d.update(step=99))
    new_sha = Manifest.from_bytes(store.get(head.manifest), head.manifest).sha256
    rewrite(store, HEAD_KEY, lambda d: d.update(manifest_sha256=new_sha))
    refused(store, ver, SignatureError, "HEAD .*signature does not match")
    # ... and HEAD re-signed by the attacker's own key: not trusted
    rewrite(store, HEAD_KEY, lambda d: None, sign_with=Signer(OTHER, "run-a"))
    refused(store, ver, SignatureError, "does not trust")
    # HEAD restored, the edited manifest stays: its own signature no longer matches its body
    store.put(HEAD_KEY, saved[HEAD_KEY])
    refused(store, Verifier([KEY.public_key()]), SignatureError,
            f"manifest {head.manifest}: the signature does not match")
    # a part's sha256 swapped in the signed manifest (to smuggle another object): same
    store.put(head.manifest, saved[head.manifest])
    rewrite(store, head.manifest, lambda d: d["parts"][0].update(sha256="0" * 64))
    store.put(HEAD_KEY, saved[HEAD_KEY])
    refused(store, Verifier([KEY.public_key()]), SignatureError, "signature does not match")
    # the signature removed altogether: unsigned
    store.put(head.manifest, saved[head.manifest])
    rewrite(store, HEAD_KEY, lambda d: d.pop("signature"))
    refused(store, Verifier([KEY.public_key()]), UnsignedError, "HEAD .*not signed")


def _edit_newest(store, edit, fix_head=True, sign_with=None):
    """The attacker, format 3: edit the manifest HEAD carries and fix its checksum, and (with
    ``fix_head``) HEAD's record of it; HEAD's own checksum always."""
    def change(d):
        m = d["newest"]
        edit(m)
        m.pop("checksum")
        m["checksum"] = canonical_sha256(m)
        if fix_head:
            d["manifest_sha256"] = Manifest.from_stored(m).sha256
    rewrite(store, HEAD_KEY, change, sign_with=sign_with)


def test_an_edited_signed_manifest_in_head_is_refused(tmp_path):
    """Format 3: HEAD carries the manifest it names, covered by HEAD's signature and checked
    with its own; the stored copy is refused wherever it is read."""
    store = LocalStore(tmp_path / "s")
    publish(store, 3, Signer(KEY, "run-a"))
    head, _ = read_head(store)
    assert head.format == 4 and head.newest is not None
    ver = Verifier([KEY.public_key()])
    saved = {k: store.get(k) for k in (HEAD_KEY, head.manifest)}
    _edit_newest(store, lambda m: m.update(step=99))  # the manifest's step, HEAD's digest of it fixed
    refused(store, ver, SignatureError, "HEAD .*signature does not match")
    _edit_newest(store, lambda m: None, sign_with=Signer(OTHER, "run-a"))  # ... and re-signed by another key
    refused(store, ver, SignatureError, "does not trust")
    store.put(HEAD_KEY, saved[HEAD_KEY])
    _edit_newest(store, lambda m: m["parts"][0].update(blake3="0" * 64), fix_head=False)  # HEAD's record kept
    refused(store, Verifier([KEY.public_key()]), ManifestError, "not the manifest its referrer recorded")
    store.put(HEAD_KEY, saved[HEAD_KEY])
    _edit_newest(store, lambda m: m["parts"][0].update(blake3="0" * 64))  # a part's checksum swapped
    refused(store, Verifier([KEY.public_key()]), SignatureError, "signature does not match")
    store.put(HEAD_KEY, saved[HEAD_KEY])
    rewrite(store, HEAD_KEY, lambda d: d.pop("signature"))  # the signature removed altogether: unsigned
    refused(store, Verifier([KEY.public_key()]), UnsignedError, "HEAD .*not signed")
    # HEAD intact, the stored manifest edited: a follower of HEAD has the signed copy in HEAD...
    store.put(HEAD_KEY, saved[HEAD_KEY])
    rewrite(store, head.manifest, lambda d: d.update(step=99))
    recv = zeros_like(state())
    assert Follower(store, recv, verifier=Verifier([KEY.public_key()])).sync().version == head.version
    # ... and anyone reading the stored one is refused by its signature
    with pytest.raises(SignatureError, match=f"manifest {head.manifest}: the signature does not match"):
        Verifier([KEY.public_key()]).check_manifest(Manifest.from_bytes(store.get(head.manifest), head.manifest))


def test_a_rolled_back_head_is_refused_once_a_newer_version_was_verified(store):
    pub, snaps = publish(store, 2, Signer(KEY, "run-a"))
    old_head = store.get(HEAD_KEY)
    s = {k: v.clone() for k, v in snaps[-1].items()}
    step(s, 9)
    pub.publish(s)
    recv = zeros_like(s)
    f = Follower(store, recv, verifier=Verifier([KEY.public_key()], namespace="run-a"))
    assert f.sync().version == 2
    store.put(HEAD_KEY, old_head)  # validly signed, but older: a replay
    with pytest.raises(ReplayError, match="older than version 2"):
        f.sync()
    with pytest.raises(ReplayError):
        f.latest()
    assert f.version == 2
    assert_state(recv, s)


def test_a_rewritten_history_at_the_same_version_is_refused(tmp_path):
    a, b = LocalStore(tmp_path / "a"), LocalStore(tmp_path / "b")
    publish(a, 2, Signer(KEY, "run-a"))
    s = state(5)
    publish(b, 2, Signer(KEY, "run-a"), s=s)  # the same run name, another history (same key)
    recv = zeros_like(s)
    f = Follower(a, recv, verifier=Verifier([KEY.public_key()], namespace="run-a"))
    assert f.sync().version == 1
    for k in b.list(""):
        a.put(k, b.get(k))  # b's versions and HEAD copied over a's
    with pytest.raises(ReplayError, match="another manifest for version 1"):
        f.sync()


def test_a_namespace_pinned_on_first_use_refuses_another_runs_versions(tmp_path):
    a, b = LocalStore(tmp_path / "a"), LocalStore(tmp_path / "b")
    _, snaps = publish(a, 1, Signer(KEY, "run-a"))
    publish(b, 4, Signer(KEY, "run-b"))
    recv = zeros_like(snaps[0])
    f = Follower(a, recv, verifier=Verifier([KEY.public_key()]))  # no namespace given
    assert f.sync().version == 0
    for k in b.list(""):
        a.put(k, b.get(k))  # newer versions, validly signed by the same key, but of run-b
    with pytest.raises(SignatureError, match="namespace 'run-b', not 'run-a'"):
        f.sync()
    assert_state(recv, snaps[0])


@pytest.mark.parametrize("fv", [2, 3])
def test_a_manifest_copied_to_another_versions_key_is_refused(tmp_path, fv):
    store = LocalStore(tmp_path / "s")
    publish(store, 3, Signer(KEY, "run-a"), format_version=fv)
    head, _ = read_head(store)
    old = [k for k in store.list("versions/000000000000/") if k.endswith("manifest.json")][0]
    if fv == 2:
        store.put(head.manifest, store.get(old))  # version 0's signed manifest where version 2's was
    else:  # ... where HEAD carries version 2's
        rewrite(store, HEAD_KEY, lambda d: d.update(newest=json.loads(store.get(old))))
    rec, keys = reader(store)
    with pytest.raises(ManifestError, match="names itself"):
        Follower(rec, zeros_like(state()), verifier=Verifier([KEY.public_key()])).sync()
    assert not [k for k in keys if k.endswith(".dcr")]


# ----------------------------------------------------------------------------- rotation

def test_key_rotation_old_versions_stay_verifiable(tmp_path):
    store = LocalStore(tmp_path / "s")
    pub, snaps = publish(store, 3, Signer(KEY, "run-a"), keyframe_every=0)
    s = {k: v.clone() for k, v in snaps[-1].items()}
    with pytest.raises(SignatureError, match="does not trust"):  # a key it is not told about: the wrong key?
        Publisher(store, signer=Signer(OTHER, "run-a")).publish(snaps[-1])
    # the new key continues the chain it is told to trust (the old key's)
    pub2 = Publisher(store, signer=Signer(OTHER, "run-a"), trusted_keys=[KEY.public_key()])
    for i in range(3, 5):
        step(s, i)
        pub2.publish(s)
    both = Verifier([KEY.public_key(), OTHER.public_key()], namespace="run-a")
    recv = zeros_like(s)
    f = Follower(store, recv, verifier=both)
    r = f.sync()  # keyframe 0 (old key) + deltas 1..4 (old key, then new)
    assert r.version == 4 and r.path == "keyframe 0 + deltas 1..4"
    assert_state(recv, s)
    recv3 = zeros_like(s)
    assert Follower(store, recv3, verifier=both).sync(3).version == 3  # an old version, still verifiable
    # a follower that trusts the new key alone cannot use the chain the old key signed
    refused(store, Verifier([OTHER.public_key()], namespace="run-a"), SignatureError, "does not trust")
    # a publisher pointed at this store with another namespace refuses before writing anything
    n = len(store.list(""))
    with pytest.raises(SignatureError, match="signed for namespace 'run-a'"):
        Publisher(store, signer=Signer(OTHER, "run-z")).publish(s)
    assert len(store.list("")) == n  # nothing written
    assert read_head(store)[0].version == 4


# ----------------------------------------------------------------------------- relay, env, CLI

def test_signed_versions_through_a_relay(tmp_path):
    store = LocalStore(tmp_path / "s")
    pub, snaps = publish(store, 2, Signer(KEY, "run-a"))
    r = RelayProc(store.url)
    try:
        ver = Verifier([KEY.public_key()], namespace="run-a")
        recv = zeros_like(snaps[0])
        f = Follower(open_store(r.url), recv, verifier=ver)
        assert f.sync().version == 1
        assert_state(recv, snaps[1])
        # the long poll is verified too
        got = f.store.wait_head(None, 0)
        assert Head.from_bytes(got[0]).version == 1
        old_head = store.get(HEAD_KEY)
        s = {k: v.clone() for k, v in snaps[-1].items()}
        step(s, 7)
        pub.publish(s)
        assert f.sync().version == 2
        store.put(HEAD_KEY, old_head)  # rolled back at the source: the relay serves it, the follower refuses
        with pytest.raises(ReplayError):
            f.sync()
        with pytest.raises(ReplayError):
            f.store.wait_head(None, 0)
        # an unsigned HEAD served by the relay is refused by a fresh follower before any part
        rewrite(store, HEAD_KEY, lambda d: d.pop("signature"))
        refused(open_store(r.url), Verifier([KEY.public_key()]), UnsignedError, "not signed")
    finally:
        r.stop()


def test_keys_from_the_environment(tmp_path, monkeypatch):
    store = LocalStore(tmp_path / "s")
    (tmp_path / "k.pem").write_bytes(private_key_pem(KEY))
    (tmp_path / "k.pem").chmod(0o600)  # a private key others may read is refused (test_key_files.py)
    (tmp_path / "k.pub").write_text(f"# rotation: old and new\n{public_key_text(OTHER)}\n{public_key_text(KEY)}\n")
    monkeypatch.setenv("NEMO_DCR_SIGNING_KEY_FILE", str(tmp_path / "k.pem"))
    monkeypatch.setenv("NEMO_DCR_NAMESPACE", "run-env")
    _, snaps = publish(store, 2, "env")
    assert read_head(store)[0].signature["namespace"] == "run-env"
    monkeypatch.setenv("NEMO_DCR_TRUSTED_KEYS_FILE", str(tmp_path / "k.pub"))
    f = Follower(store, zeros_like(snaps[0]))  # verifier="env"
    assert f.store.verifier.namespace == "run-env" and f.sync().version == 1
    monkeypatch.delenv("NEMO_DCR_TRUSTED_KEYS_FILE")
    monkeypatch.setenv("NEMO_DCR_TRUSTED_KEYS", public_key_text(OTHER))
    refused(store, "env", SignatureError, "does not trust")
    monkeypatch.delenv("NEMO_DCR_NAMESPACE")
    with pytest.raises(SignatureError, match="no namespace"):
        Publisher(store)
    monkeypatch.setenv("NEMO_DCR_SIGNING_KEY", "-----BEGIN PRIVATE KEY-----\nnot-a-key\n-----END PRIVATE KEY-----")
    with pytest.raises(SignatureError, match=r"\$NEMO_DCR_SIGNING_KEY is not") as ei:
        Publisher(store)
    assert "not-a-key" not in str(ei.value)
    assert verifying(store, None) is store


def test_cli_keygen_publish_pull_with_signatures(tmp_path, cli):
    from safetensors.torch import save_file
    s = state()
    save_file(s, str(tmp_path / "m.safetensors"))
    r = cli("keygen", str(tmp_path / "run.key"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "run.key").stat().st_mode & 0o077 == 0
    pub = (tmp_path / "run.key.pub").read_text()
    assert pub.startswith("ed25519:") and pub.strip() in r.stdout
    assert cli("keygen", str(tmp_path / "run.key")).returncode == 1  # never overwrites a key
    store = str(tmp_path / "store")
    r = cli("publish", "--store", store, "--signing-key", str(tmp_path / "run.key"), "--namespace", "run-cli",
            str(tmp_path / "m.safetensors"))
    assert r.returncode == 0, r.stderr
    r = cli("pull", "--store", store, "--into", str(tmp_path / "out.safetensors"),
            "--trusted-key", str(tmp_path / "run.key.pub"), "--namespace", "run-cli")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out.safetensors").read_bytes() == (tmp_path / "m.safetensors").read_bytes()
    r = cli("pull", "--store", store, "--into", str(tmp_path / "o2.safetensors"),
            "--trusted-key", public_key_text(OTHER))
    assert r.returncode == 1 and "does not trust" in r.stderr and not (tmp_path / "o2.safetensors").exists()
    r = cli("log", "--store", store, "--trusted-key", public_key_text(KEY))
    assert r.returncode == 1 and "does not trust" in r.stderr
    r = cli("publish", "--store", store, "--signing-key", str(tmp_path / "run.key"),
            str(tmp_path / "m.safetensors"))
    assert r.returncode == 1 and "namespace" in r.stderr


def test_signer_and_verifier_never_show_key_material(tmp_path):
    signer = Signer(KEY, "run-a")
    pem = private_key_pem(KEY).decode()
    body = "".join(pem.splitlines()[1:-1])
    assert body not in repr(signer) and signer.key_id in repr(signer)
    (tmp_path / "bad.pem").write_text(pem.replace("PRIVATE KEY-----\n", "PRIVATE KEY-----\nAAAA", 1))
    (tmp_path / "bad.pem").chmod(0o600)
    with pytest.raises(SignatureError) as ei:
        Signer.from_file(tmp_path / "bad.pem", "run-a")
    assert body[:20] not in str(ei.value) and "bad.pem" in str(ei.value)


# ----------------------------------------------------------------------------- publishing onto a signed chain

def test_an_unsigned_or_foreign_signed_publish_onto_a_signed_chain_is_refused(tmp_path, cli):
    """One mistaken command (signing key forgotten, or the wrong key) must not brick every
    verifying receiver: nothing is written, and the error says why and what to do."""
    from safetensors.torch import save_file
    store = LocalStore(tmp_path / "s")
    _, snaps = publish(store, 2, Signer(KEY, "run-a"))
    s = {k: v.clone() for k, v in snaps[-1].items()}
    step(s, 5)
    n, head = sorted(store.list("")), read_head(store)[0]
    for signer in (None, Signer(OTHER, "run-a")):
        for kf in (False, True):
            with pytest.raises(SignatureError) as ei:
                Publisher(store, signer=signer).publish(s, keyframe=kf)
            assert "signed" in str(ei.value) and ("signing key" in str(ei.value) or "trust" in str(ei.value))
            assert sorted(store.list("")) == n and read_head(store)[0] == head  # nothing written
    save_file(s, str(tmp_path / "m.safetensors"))
    r = cli("publish", "--store", tmp_path / "s", tmp_path / "m.safetensors")
    assert r.returncode == 1 and "signed" in r.stderr and "--signing-key" in r.stderr, r.stderr
    assert sorted(store.list("")) == n
    # receivers that verify still follow the chain, and the right key extends it
    Publisher(store, signer=Signer(KEY, "run-a")).publish(s)
    recv = zeros_like(s)
    assert Follower(store, recv, verifier=Verifier([KEY.public_key()], namespace="run-a")).sync().version == 2
    assert_state(recv, s)


def test_a_publisher_does_not_build_on_a_forged_head(tmp_path):
    """Someone with write access but not the key commits a version (a real Publisher playing
    the forger). The publisher that holds its own last version continues from it, above the
    forgery; a fresh one refuses a delta and replaces the forgery with a keyframe when asked.
    A verifying receiver never applies the forged state and follows both."""
    store = LocalStore(tmp_path / "s")
    signer = Signer(KEY, "run-a")
    pub, snaps = publish(store, 2, signer)
    s = {k: v.clone() for k, v in snaps[-1].items()}
    forged = {k: torch.zeros_like(v) for k, v in s.items()}
    for forger in (None, Signer(OTHER, "run-a")):
        Publisher(store, signer=forger, allow_unverified_chain=True).publish(forged, keyframe=True)
        step(s, 7)
        r = pub.publish(s)  # continues from its own version, not the forged one
        assert r.manifest.base_version == r.version - 2 and r.manifest.parts  # a delta on its own version
        recv = zeros_like(s)
        f = Follower(store, recv, verifier=Verifier([KEY.public_key()], namespace="run-a"))
        assert f.sync().version == r.version
        assert_state(recv, s)
    Publisher(store, signer=None, allow_unverified_chain=True).publish(forged, keyframe=True)
    fresh = Publisher(store, signer=signer)
    step(s, 9)
    with pytest.raises(SignatureError, match="keyframe"):
        fresh.publish(s)
    r = fresh.publish(s, keyframe=True)
    assert r.manifest.is_keyframe and not r.manifest.parts and r.manifest.base_version is None
    recv = zeros_like(s)
    assert Follower(store, recv, verifier=Verifier([KEY.public_key()], namespace="run-a")).sync().version == r.version
    assert_state(recv, s)
