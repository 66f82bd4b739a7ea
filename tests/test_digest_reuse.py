"""The two ways whole-tensor digests got cheaper without changing what they are: ``diff`` reuses
a private base's known digest (``base_digests``: the publisher's snapshot), and ``apply`` hashes
the target while it writes (``RunningDigest``). Both must give exactly the digests and bytes of
hashing from scratch, and every check must still fire (a wrong target digest through the
pipelined check: tests/test_errors.py::test_wrong_target_digest_is_target_mismatch)."""
from __future__ import annotations

import pytest
import torch

from dcr_testing import assert_state, zeros_like
from dcr_testing.deltas import same_delta
from nemo_dcr import BaseMismatchError, DeltaReader, Follower, Publisher, apply, diff
from nemo_dcr.state.digest import RunningDigest, tensor_digest
from nemo_dcr.stores.local import LocalStore


def _states(seed=0):
    g = torch.Generator().manual_seed(seed)
    base = {"w": torch.randn(300, 70, generator=g).to(torch.bfloat16), "b": torch.randn(257, generator=g),
            "ids": torch.randint(0, 1 << 40, (33, 3), generator=g)}
    target = {k: v.clone() for k, v in base.items()}
    target["w"].view(-1)[::97] = torch.randn(target["w"].numel() // 97 + 1, generator=g).to(torch.bfloat16)
    target["b"][5] = -0.0
    return base, target




@pytest.mark.parametrize("algo", ["blake3", "sha256", "blake2b"])
def test_running_digest_equals_tensor_digest(algo):
    t = torch.arange(5 * 7 * 11, dtype=torch.int32).reshape(5, 7, 11)
    for v in (t, t.transpose(0, 2), t[:, ::2], t[:0]):
        r = RunningDigest(v, algo)
        for end in (0, 3, 3, 40, v.numel() + 10):  # repeated, past the end: harmless
            r.advance(end)
        assert r.hexdigest() == tensor_digest(v, algo)


def test_diff_with_known_base_digests_gives_the_same_delta():
    base, target = _states()
    plain = diff(base, target, chunk_elems=4096)
    first = diff({}, base, chunk_elems=4096)  # what a publisher wrote when it published ``base``
    known = {e.name: e.target_digest for e in DeltaReader.open(first).header.tensors}
    reused = diff(base, target, chunk_elems=4096, base_digests=known)
    same_delta(plain, reused)  # every field and payload byte but the creation time (format 3: and offsets)
    recv = {k: v.clone() for k, v in base.items()}
    apply(recv, reused)
    assert_state(recv, target)


@pytest.mark.parametrize("fv, prefix", [(2, "blake3:"), (3, "sd:")])
def test_known_base_digest_is_what_the_delta_claims(fv, prefix):
    """A wrong known digest is written as is (the caller vouches for its private base), and every
    receiver holding the real base refuses the delta before writing: nothing is hidden."""
    base, target = _states()
    blob = diff(base, target, chunk_elems=4096, base_digests={"w": prefix + "0" * 32}, format_version=fv)
    entry = {e.name: e for e in DeltaReader.open(blob).header.tensors}["w"]
    assert entry.base_digest == prefix + "0" * 32
    recv = {k: v.clone() for k, v in base.items()}
    with pytest.raises(BaseMismatchError):
        apply(recv, blob)
    assert_state(recv, base)


def test_publisher_reuses_its_snapshot_digests(tmp_path):
    """Three versions through a publisher (the second and third diff against a snapshot whose
    digests the previous diff wrote) and a follower that checks every base and target digest."""
    store = LocalStore(tmp_path / "store")
    pub = Publisher(store, chunk_elems=4096)
    states = [_states(0)[0], _states(0)[1]]
    third = {k: v.clone() for k, v in states[1].items()}
    third["ids"][0, 0] += 1
    states.append(third)
    recv = zeros_like(states[0])
    fol = Follower(store, recv)
    for s in states:
        pub.publish(s)
        fol.sync()
        assert_state(recv, s)


def test_publisher_hashes_each_tensor_once_per_version(tmp_path, monkeypatch):
    """Format version 2: after the first version the publisher's diff hashes only the target,
    not its snapshot."""
    import sys

    diff_mod = sys.modules["nemo_dcr.delta.diff"]  # (the package's ``diff`` attribute is the function)
    hashed = []
    real = diff_mod.tensor_digest
    monkeypatch.setattr(diff_mod, "tensor_digest", lambda t, *a, **k: hashed.append(t.data_ptr()) or real(t, *a, **k))
    base, target = _states()
    pub = Publisher(LocalStore(tmp_path / "store"), chunk_elems=4096, format_version=2)
    pub.publish(base)  # the first version: a keyframe, each tensor hashed once
    assert len(hashed) == len(base)
    hashed.clear()
    pub.publish(target)
    assert len(hashed) == len(target)  # target digests only; the snapshot's were known
    snap, _ = pub.published
    # of the tensors published (read in place; the snapshot follows them by the changes), never
    # of the snapshot, which now holds exactly what was published
    assert set(hashed) <= {t.data_ptr() for t in target.values()}
    assert not set(hashed) & {t.data_ptr() for t in snap.values()}
    assert_state(snap, target)
    hashed.clear()
    third = {k: v.clone() for k, v in target.items()}
    next(iter(third.values())).view(-1)[0] += 1
    pub.publish(third)  # a delta after a delta: the digests the previous delta wrote are reused too
    assert len(hashed) == len(third)


@pytest.mark.parametrize("fv", [3, 4, 5])
def test_publisher_of_formats_3_to_5_hashes_no_tensor_whole(tmp_path, monkeypatch, fv):
    """Format versions 3, 4 (the default) and 5: the tensor digests are sums, the keyframe's summed
    from its chunks and each delta's from the base's and the changes: no tensor is hashed whole by
    a publish, and a follower checking every digest agrees. In version 4 the tensor digests are
    the state digest's terms, so the first version's state digest is no pass of its own either."""
    import sys

    from nemo_dcr.state import digest, statedigest
    diff_mod = sys.modules["nemo_dcr.delta.diff"]
    hashed = []
    # (statedigest._pieces: each tensor a state digest reads, tensor_contrib's and state_contrib's;
    # _one_run: each one state_contrib sums in one call with others)
    for mod, fn in ((diff_mod, "tensor_digest"), (statedigest, "_pieces"), (digest, "RunningDigest")):
        real = getattr(mod, fn)
        monkeypatch.setattr(mod, fn, lambda *a, _real=real, **k: hashed.append(a[0]) or _real(*a, **k))
    real_run = statedigest._one_run
    monkeypatch.setattr(statedigest, "_one_run",
                        lambda name, *a: (lambda r: r is not None and hashed.append(name) or r)(real_run(name, *a)))
    base, target = _states()
    store = LocalStore(tmp_path / "store")
    pub = Publisher(store, chunk_elems=4096, format_version=fv)
    third = {k: v.clone() for k, v in target.items()}
    next(iter(third.values())).view(-1)[0] += 1
    pub.publish(base)  # the keyframe: its tensor digests summed from its chunks; in version 3 the
    assert hashed == (list(base) if fv == 3 else [])  # first state digest (keyed by name) is a pass of its own
    hashed.clear()
    for s in (target, third):
        pub.publish(s)
    assert hashed == []  # the deltas: O(changes)
    monkeypatch.undo()
    recv = zeros_like(base)
    fol = Follower(store, recv)
    fol.sync(0)
    algo = {3: "sd", 4: "sdn", 5: "sdb"}[fv]
    for v, s in ((1, target), (2, third)):
        fol.sync(v)
        assert_state(recv, s)
        assert fol.manifest is not None and fol.manifest.parts
        assert fol.manifest.target_digest == statedigest.state_contrib(s, definition=2 if fv == 5 else 1).hex()
        for p in fol.manifest.parts:
            for e in DeltaReader.open(store.get(p.key)).header.tensors:
                assert e.target_digest == digest.tensor_digest(s[e.name], algo, place=digest.Place(e.name)), e.name
