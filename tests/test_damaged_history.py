"""A damaged or lost manifest or HEAD in the store (issue 14; the campaign's manifest_* and
head_* faults): receivers apply nothing wrong and raise a typed error, keeping the version they
hold; the publisher that wrote the newest manifest goes on (it holds the manifest itself); any
other publisher fails with an error that names the remedy, and that remedy -- a keyframe --
works; retention never turns a committed version into a failed publish.

Found by the campaign: before, a damaged newest manifest stopped every publisher for good, a
keyframe publish included (the commit read the base manifest from the store), and a damaged HEAD
could only be repaired by hand."""
import pytest
import torch

from dcr_testing import assert_state, zeros_like
from nemo_dcr.errors import DcrError, ManifestError, PublishError
from nemo_dcr.sync.follower import Follower
from nemo_dcr.sync.publisher import Publisher
from nemo_dcr.sync.versions import HEAD_KEY, read_head


def state(i):
    g = torch.Generator().manual_seed(i)
    return {"w": torch.randn(32, 16, generator=g).bfloat16(), "b": torch.randn(16, generator=g)}


def damage(store, key, how):
    data = store.get(key)
    if how == "corrupt":  # one bit of one byte in the middle
        i = len(data) // 2
        store.put(key, data[:i] + bytes([data[i] ^ 0x04]) + data[i + 1:])
    elif how == "truncate":
        store.put(key, data[: len(data) // 2])
    else:
        store.delete(key)


def follower(store, recv):
    return Follower(store, recv, verifier=None, backoff=0.0)


@pytest.mark.parametrize("how, fv", [("corrupt", 2), ("delete", 2), ("corrupt", 3), ("delete", 3)])
def test_a_damaged_newest_manifest_stops_nothing_that_can_go_on(store, how, fv):
    states = [state(i) for i in range(5)]
    pub = Publisher(store, signer=None, format_version=fv)
    pub.publish(states[0])
    held = zeros_like(states[0])
    f_held = follower(store, held)
    pub.publish(states[1])
    f_held.sync()
    damage(store, read_head(store)[0].manifest, how)

    fresh = zeros_like(states[0])
    f_fresh = follower(store, fresh)
    if fv == 2:
        # a receiver that does not hold version 1 cannot read it: a typed error, nothing applied
        with pytest.raises(DcrError):
            f_fresh.sync()
        assert f_fresh.version is None
        assert_state(fresh, zeros_like(states[0]))
    else:  # format 3: HEAD carries version 1's manifest, so the copy in the store is not needed
        assert f_fresh.sync().version == 1
        assert_state(fresh, states[1])
        fresh = zeros_like(states[0])
        f_fresh = follower(store, fresh)

    # the publisher that wrote version 1 holds its manifest: it publishes the next delta, and the
    # receiver holding version 1 (and its manifest) follows it
    r = pub.publish(states[2])
    assert r.version == 2 and r.manifest.parts and r.manifest.base_version == 1
    f_held.sync()
    assert f_held.version == 2
    assert_state(held, states[2])
    with pytest.raises(DcrError):  # the chain to version 2 still runs through version 1
        f_fresh.sync()
    assert_state(fresh, zeros_like(states[0]))

    # a restarted publisher cannot rebuild its base: a clear error naming the remedy, which works
    pub2 = Publisher(store, signer=None, format_version=fv)
    with pytest.raises(PublishError):
        pub2.publish(states[3])
    assert read_head(store)[0].version == 2  # nothing committed
    r = pub2.publish(states[3], keyframe=True)
    assert r.version == 3 and r.manifest.is_keyframe
    for f, recv in ((f_fresh, fresh), (f_held, held)):
        f.sync()
        assert f.version == 3
        assert_state(recv, states[3])


def test_a_keyframe_goes_on_when_the_manifest_it_follows_is_unreadable(store):
    """Format 2 (HEAD names the manifest; format 3 carries it, see the test above)."""
    states = [state(i) for i in range(3)]
    pub = Publisher(store, signer=None, format_version=2)
    pub.publish(states[0])
    pub.publish(states[1])
    damage(store, read_head(store)[0].manifest, "corrupt")
    pub2 = Publisher(store, signer=None, format_version=2)
    with pytest.raises(PublishError, match="keyframe=True"):
        pub2.publish(states[2])
    r = pub2.publish(states[2], keyframe=True)  # before the fix: "commit failed: ManifestError"
    assert r.manifest.is_keyframe and r.manifest.base_version is None and not r.manifest.parts
    recv = zeros_like(states[0])
    f = follower(store, recv)
    f.sync()
    assert f.version == 2
    assert_state(recv, states[2])


def followed(store, n: int):
    """``n`` states, versions 0 and 1 of them published, and a follower holding version 1."""
    states = [state(i) for i in range(n)]
    pub = Publisher(store, signer=None)
    pub.publish(states[0])
    pub.publish(states[1])
    recv = zeros_like(states[0])
    f = follower(store, recv)
    f.sync()
    return states, pub, recv, f


def test_a_restarted_publisher_of_format_3_rebuilds_from_the_manifest_head_carries(store):
    """Format 3: the newest manifest damaged in the store; HEAD carries it, so a restarted
    publisher rebuilds its base and publishes the next delta (format 2 needed a keyframe)."""
    states, _, recv, f = followed(store, 3)
    damage(store, read_head(store)[0].manifest, "corrupt")
    r = Publisher(store, signer=None).publish(states[2])
    assert r.version == 2 and r.manifest.parts and r.manifest.base_version == 1
    assert f.sync().steps == [("delta", 2)]
    assert_state(recv, states[2])


@pytest.mark.parametrize("how", ["corrupt", "truncate"])
def test_a_damaged_head_is_a_typed_error_everywhere_and_a_keyframe_replaces_it(store, how):
    states, pub, recv, f = followed(store, 4)
    damage(store, HEAD_KEY, how)

    with pytest.raises(ManifestError):  # the receiver keeps what it holds
        f.sync()
    assert f.version == 1
    assert_state(recv, states[1])
    for p in (pub, Publisher(store, signer=None)):
        with pytest.raises(ManifestError, match="keyframe=True"):
            p.publish(states[2])
    # a keyframe replaces HEAD, numbered above every version in the store
    r = Publisher(store, signer=None).publish(states[2], keyframe=True)
    assert r.version == 2 and r.manifest.is_keyframe and r.manifest.base_version is None
    assert read_head(store)[0].manifest == r.manifest.key
    f.sync()
    assert f.version == 2
    assert_state(recv, states[2])
    # and the first publisher goes on from it (it rebuilds its base from the new keyframe)
    r = pub.publish(states[3])
    assert r.version == 3 and r.manifest.parts
    f.sync()
    assert_state(recv, states[3])


def test_retention_past_a_damaged_manifest_does_not_fail_a_committed_publish(store):
    states = [state(i) for i in range(6)]
    pub = Publisher(store, signer=None, retain=1, keyframe_every=4)
    for i in range(3):
        pub.publish(states[i])
    damage(store, read_head(store)[0].manifest, "corrupt")  # version 2, on the chain retention walks
    r = pub.publish(states[3])  # before the fix: retention's ManifestError raised after the commit
    assert r.version == 3 and read_head(store)[0].version == 3
    recv = zeros_like(states[0])
    f = follower(store, recv)
    pub.publish(states[4], keyframe=True)  # version 4, a keyframe: the cutoff moves past version 2
    f.sync()
    assert_state(recv, states[4])
    r = pub.publish(states[5])
    assert not any(k.startswith(f"versions/{v:012d}/") for k in store.list("versions/") for v in range(3))


@pytest.mark.parametrize("forger", ["unsigned", "other key"])
def test_a_forged_version_in_the_chain_does_not_stop_a_verifier_at_the_next_keyframe(store, forger):
    # found by the signed campaign: someone with store access but not the key publishes a
    # version; the real publisher (which checks only the namespace of the HEAD it extends)
    # builds on it and signs; receivers refuse the forgery, and before the fix they refused
    # every later version too, keyframes included: the walk back from a signed keyframe
    # raised the forged base's SignatureError instead of offering the keyframe
    from nemo_dcr.errors import SignatureError
    from nemo_dcr.sync.signing import Signer, Verifier, generate_key
    key = generate_key()
    states = [state(i) for i in range(5)]
    pub = Publisher(store, signer=Signer(key, "run-1"))
    pub.publish(states[0])
    pub.publish(states[1])
    recv = zeros_like(states[0])
    f = Follower(store, recv, verifier=Verifier([key.public_key()], "run-1"), backoff=0.0)
    f.sync()
    forged = Signer(generate_key(), "run-1") if forger == "other key" else None
    Publisher(store, signer=forged, allow_unverified_chain=True).publish(state(99), keyframe=True)
    with pytest.raises(SignatureError):  # refused at HEAD, before any part is fetched
        f.sync()
    assert f.version == 1
    assert_state(recv, states[1])
    # a publisher now refuses to build on a HEAD it cannot verify (test_signing.py); one that did
    # (before that check, played here with allow_unverified_chain) signed a delta on the forgery
    pub = Publisher(store, signer=Signer(key, "run-1"), allow_unverified_chain=True)
    pub.publish(states[2])  # a signed delta on the forged base: no way there for a verifier
    with pytest.raises(DcrError):
        f.sync()
    assert_state(recv, states[1])
    r = pub.publish(states[3], keyframe=True)  # version 4: 2 is the forgery, 3 the delta on it
    f.sync()
    assert f.version == r.version == 4
    assert_state(recv, states[3])
