"""Relay cache poisoning (issue 22): a parent relay, or anything on the plain-HTTP link, serves a
forged manifest that passes its own checksum. The child relay used to keep it (it checked only
that a manifest parses and names itself), and every receiver behind it then failed with
ManifestError until eviction, a [relay, store] fallback list included. A relay keeps only what
the store's recorded identity vouches for. Real relay processes; the liar is a plain HTTP server
between the child and its parent (dcr_testing.lying)."""
import pytest

from dcr_testing import assert_state, zeros_like
from dcr_testing.lying import LyingParent
from dcr_testing.relay import RelayProc, model, train_step
from nemo_dcr.errors import DcrError, ManifestError
from nemo_dcr.stores import FallbackStore, HttpStore, open_store
from nemo_dcr.sync.follower import Follower
from nemo_dcr.sync.publisher import Publisher
from nemo_dcr.sync.versions import Head, Manifest, read_head

pytest.importorskip("aiohttp")


def _forge(store, head: Head) -> tuple[str, bytes]:
    """HEAD's manifest, altered and re-sealed: it parses, names itself, passes its checksum."""
    m = Manifest.from_bytes(store.get(head.manifest), head.manifest)
    m.meta = {**m.meta, "forged": True}
    m.signature = None
    return head.manifest, m.to_bytes()


def _forge_head_and_manifest(store, liar, child):
    """A consistent forgery: HEAD's manifest altered and a HEAD recording its identity (a signed
    HEAD's signature no longer matches). The child serves both, twice; -> (child, key)."""
    head, _ = read_head(store)
    key, fake = _forge(store, head)
    bad_head = Head(**{**head.__dict__, "manifest_sha256": Manifest.from_bytes(fake, key).sha256})
    liar.forged.update({key: fake, "HEAD": bad_head.to_bytes()})
    sc = HttpStore(child.url)
    assert sc.get_with_tag("HEAD")[0] == bad_head.to_bytes()
    assert sc.get(key) == fake and sc.get(key) == fake
    return sc, key


def _tree(tmp_path, *relay_args, signer=None, format_version=3):
    store = open_store(tmp_path / "store")
    state = model()
    pub = Publisher(store, signer=signer, format_version=format_version)
    pub.publish(state)
    train_step(state, 1)
    pub.publish(state)
    parent = RelayProc(store.url)
    liar = LyingParent(parent.url)
    try:
        child = RelayProc(liar.url, *relay_args)
    except BaseException:  # leave no process behind
        liar.stop()
        parent.stop()
        raise
    return store, state, parent, liar, child


def test_a_forged_manifest_is_not_kept_and_receivers_recover_once_the_parent_is_honest(tmp_path):
    """Format 2: HEAD names the manifest, and receivers read the manifest object."""
    store, state, parent, liar, child = _tree(tmp_path, format_version=2)
    try:
        head, _ = read_head(store)
        key, fake = _forge(store, head)
        liar.forged[key] = fake
        f = Follower(FallbackStore([HttpStore(child.url), store], retry_after=0), zeros_like(state), verifier=None)
        with pytest.raises(ManifestError, match="not the manifest its referrer recorded"):
            f.sync()
        assert liar.served[key] == 1
        del liar.forged[key]  # the parent turns honest
        assert f.sync().version == 1  # failed here before: the child kept serving the forgery
        assert_state(f.tensors, state)
        sc = HttpStore(child.url)
        assert sc.stats()["bad_objects"] >= 1  # the forgery was refused, not kept
        assert sc.get(key) == store.get(key)
    finally:
        child.stop()
        liar.stop()
        parent.stop()


def test_a_forged_head_vouches_only_until_an_honest_head_records_another_identity(tmp_path):
    """The liar forges HEAD too, recording its forged manifest's identity: the child keeps the
    forgery (HEAD vouched for it) but drops it, and its version's objects, as soon as it reads
    an honest HEAD that records another identity for that key. (Format 2: a format-3 HEAD
    carries the manifest, and the forgery would have to be in HEAD.)"""
    store, state, parent, liar, child = _tree(tmp_path, "--poll-interval", "0.05", format_version=2)
    try:
        sc, key = _forge_head_and_manifest(store, liar, child)
        assert liar.served[key] == 1  # kept: the (forged) HEAD vouched for it
        liar.forged.clear()  # honest again
        f = Follower(FallbackStore([sc, store], retry_after=0), zeros_like(state), verifier=None)
        assert f.sync().version == 1
        assert_state(f.tensors, state)
        st = sc.stats()
        assert st["withdrawn_objects"] >= 1, st
        assert sc.get(key) == store.get(key)
    finally:
        child.stop()
        liar.stop()
        parent.stop()


def test_a_forged_manifest_object_is_not_needed_with_format_3(tmp_path):
    """Format 3: HEAD carries the manifest it records. A receiver reads no manifest object, and
    the child relay checks the parts against HEAD's copy (vouched for by HEAD): the forged
    manifest object is never fetched, the parts are kept, a second receiver is served from the
    child's cache."""
    store, state, parent, liar, child = _tree(tmp_path)
    try:
        head, _ = read_head(store)
        assert head.newest is not None
        key, fake = _forge(store, head)
        liar.forged[key] = fake
        for _ in range(2):
            f = Follower(HttpStore(child.url), zeros_like(state), verifier=None)
            assert f.sync().version == 1
            assert_state(f.tensors, state)
        assert liar.served.get(key, 0) == 0
        st = HttpStore(child.url).stats()
        parts = [p.key for p in head.newest_manifest.parts]
        assert all(st["upstream_fetches_by_key"].get(p) == 1 for p in parts), st  # kept: fetched once
    finally:
        child.stop()
        liar.stop()
        parent.stop()


def test_with_trusted_keys_the_relay_keeps_only_signed_versions(tmp_path):
    from nemo_dcr.sync.signing import Signer, Verifier, generate_key, public_key_text
    key_ = generate_key()
    store, state, parent, liar, child = _tree(
        tmp_path, "--trusted-key", public_key_text(key_.public_key()), "--namespace", "run1",
        signer=Signer(key_, "run1"))
    try:
        sc, key = _forge_head_and_manifest(store, liar, child)
        assert liar.served[key] == 2  # not kept: nothing signed vouched for it
        f = Follower(sc, zeros_like(state), verifier=Verifier([key_.public_key()], namespace="run1"))
        with pytest.raises(DcrError):
            f.sync()
        liar.forged.clear()
        assert f.sync().version == 1
        assert_state(f.tensors, state)
        sc.get(key)
        n = sc.stats()["upstream_fetches_by_key"][key]
        assert sc.get(key) == store.get(key)
        assert sc.stats()["upstream_fetches_by_key"][key] == n  # the signed one is kept
    finally:
        child.stop()
        liar.stop()
        parent.stop()
