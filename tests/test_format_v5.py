"""Format version 5: version 4 with the tensor digests (``"sdb:"``) and the manifests' state
digests under the state digest's definition 2 (blocked weights, docs/format.md "Definition 2"),
so that the sums over a whole tensor or state cost ~1x a memcpy where definition 1 cost ~3x.
A store may hold both: a publisher moved from format 4 to 5 (or back) writes the first version
after the move with a ``base_digest`` of the new definition, and followers and checkpoint pulls
sum their state once under it."""
from __future__ import annotations

import json
from unittest import mock

import pytest
import torch
from safetensors.torch import save_file

from dcr_testing import assert_state
from nemo_dcr import DeltaReader, ShardSpec, apply, diff
from nemo_dcr.codec import format as fmt
from nemo_dcr.errors import BaseMismatchError, DcrError, DeltaFormatError, ManifestError
from nemo_dcr.state.digest import Place, SumKey, sum_of, sum_of_all, tensor_digest
from nemo_dcr.state.statedigest import StateDigest, state_contrib, tensor_contrib
from nemo_dcr.stores import LocalStore
from nemo_dcr.sync import versions as sync_versions
from nemo_dcr.sync.follower import Follower
from nemo_dcr.sync.publisher import Publisher
from nemo_dcr.sync.versions import read_head


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(300, 70, generator=g).bfloat16(), "b": torch.randn(5000, generator=g),
            "i": torch.randint(-(1 << 40), 1 << 40, (33,), generator=g), "e": torch.zeros(0)}


def _step(state: dict, seed: int) -> None:
    """A training step's sparse change, in place (NaN payloads and -0.0 among the new values)."""
    g = torch.Generator().manual_seed(seed)
    for v in state.values():
        if v.is_floating_point() and v.numel():
            m = torch.rand(v.shape, generator=g) < 0.03
            v[m] = (v[m].float() * 1.01 + 0.001).to(v.dtype)
            v.view(-1)[seed % v.numel()] = -0.0
    state["b"].view(torch.int32)[7] = 0x7FC0_1234  # a NaN with a payload


def test_an_sdb_digest_is_the_tensors_share_of_the_definition_2_state_digest():
    """``sdb`` is ``sdn`` under definition 2: the whole tensor's digest is its term of the
    definition-2 state digest, a region's is keyed by its place, and it is not the ``sdn`` one."""
    t = torch.arange(3000, dtype=torch.float32).reshape(3, 1000)
    d = tensor_digest(t, "sdb", place=Place("a"))
    assert d == "sdb:" + tensor_contrib("a", t, definition=2).hex()
    assert d == "sdb:" + state_contrib({"a": t}, definition=2).hex()
    assert d[4:] != tensor_digest(t, "sdn", place=Place("a"))[4:]
    assert sum_of(d) == state_contrib({"a": t}, definition=2) and sum_of(d).definition == 2
    top, low = ShardSpec.of((6, 1000), (0, 0), (3, 1000)), ShardSpec.of((6, 1000), (3, 0), (3, 1000))
    assert tensor_digest(t, "sdb", place=Place("a", top)) != tensor_digest(t, "sdb", place=Place("a", low))
    with pytest.raises(ValueError, match="name and place"):
        tensor_digest(t, "sdb")
    with pytest.raises(ValueError, match="not an 'sdb' tensor digest"):
        SumKey("sdb", t.dtype, t.shape, Place("a")).parse(tensor_digest(t, "sdn", place=Place("a")))
    # digests of two definitions are never summed together: the sum would be just another number
    with pytest.raises(ValueError, match="not a summed tensor digest of definition 1"):
        sum_of_all([d, tensor_digest(t, "sdn", place=Place("b"))])
    assert sum_of_all([d], 2) == sum_of(d)


def test_a_version_5_delta_applies_bit_exactly_and_its_digests_add_up_to_the_state_digest():
    base = _state(1)
    target = {k: v.clone() for k, v in base.items()}
    _step(target, 2)
    target["new"] = torch.randn(2048).half()
    del target["i"]
    blob = diff(base, target, format_version=5, chunk_elems=4096)
    r = DeltaReader.open(blob)
    assert r.version == 5
    kept = [t for t in r.header.tensors if t.target_digest]
    assert kept and all(t.target_digest.startswith("sdb:") for t in kept)
    assert all(t.base_digest.startswith("sdb:") for t in r.header.tensors if t.base_digest)
    assert sum_of_all([t.target_digest for t in kept], 2) == state_contrib(target, definition=2)
    recv = {k: v.clone() for k, v in base.items()}
    apply(recv, blob)  # every base and target digest checked, in O(changes) where it moves
    assert_state(recv, target)
    wrong = {k: v.clone() for k, v in base.items()}
    wrong["w"].view(-1)[5] += 1
    with pytest.raises(Exception, match="base"):
        apply(wrong, blob)


def test_readers_of_versions_1_to_4_refuse_version_5_clearly(tmp_path):
    base = {"w": torch.randn(1000, generator=torch.Generator().manual_seed(5))}
    blob = diff(base, {"w": base["w"] + 1}, format_version=5)
    with mock.patch.dict(fmt.VERSIONS, {k: v for k, v in fmt.VERSIONS.items() if k < 5}, clear=True):
        with pytest.raises(DeltaFormatError, match="format version 5 is not supported"):
            DeltaReader.open(blob)
    # a manifest reader of formats 1 to 4: refused by its number, not read as a wrong state
    store = LocalStore(tmp_path)
    Publisher(store, format_version=5).publish(base)
    with mock.patch.object(sync_versions, "_READABLE", (1, 2, 3, 4)):
        with pytest.raises(ManifestError, match="format 5 is not supported"):
            read_head(store)


def test_format_5_goes_with_blake3_parts_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match="format_version 5 names each part's blake3"):
        Publisher(LocalStore(tmp_path), format_version=5, object_checksum="sha256")
    assert not list(tmp_path.iterdir())


def test_format_5_is_the_default_and_sha256_named_alone_writes_format_4(tmp_path):
    """The default is version 5 (manifest format 5). ``object_checksum="sha256"`` keeps a store
    readable by the release before manifest format 4, so named with no version it writes the
    newest version that release reads (4: manifest format 3), not a default it would refuse."""
    from nemo_dcr.sync.publisher import format_choice
    assert format_choice(None, None) == {"format_version": 5, "object_checksum": "blake3"}
    assert format_choice(None, "sha256") == {"format_version": 4, "object_checksum": "sha256"}
    assert format_choice(3, "sha256") == {"format_version": 3, "object_checksum": "sha256"}
    with pytest.raises(DcrError, match="format_version 5 names each part's blake3"):
        format_choice(5, "sha256")
    state = _state(4)
    for checksum, version, manifest_format in ((None, 5, 5), ("blake3", 5, 5), ("sha256", 4, 3)):
        store = LocalStore(tmp_path / f"s-{checksum}")
        pub = Publisher(store, object_checksum=checksum)
        assert pub.format_version == version
        m = pub.publish(state).manifest
        assert m.format == read_head(store)[0].format == manifest_format
        assert {DeltaReader.open(store.get(p.key)).version for p in m.parts + m.keyframe_parts} == {version}
        recv = {k: torch.zeros_like(v) for k, v in state.items()}
        Follower(store, recv).sync()
        assert_state(recv, state)


def test_a_format_5_store_holds_definition_2_state_digests_and_followers_check_them(tmp_path):
    state = _state(3)
    pub = Publisher(LocalStore(tmp_path), format_version=5, chunk_elems=4096)
    recv = {k: torch.zeros_like(v) for k, v in state.items()}
    f = Follower(LocalStore(tmp_path), recv)
    for step in range(3):
        m = pub.publish(state).manifest
        assert (m.format, m.definition) == (5, 2)
        assert m.target_digest == state_contrib(state, definition=2).hex()
        res = f.sync()
        assert [k for k, _ in res.steps] == (["keyframe"] if step == 0 else ["delta"])
        assert_state(recv, state)
        _step(state, 10 + step)
    f.check()  # the held state summed whole under the held manifest's definition
    recv["b"][0] += 1
    with pytest.raises(Exception, match="no longer match"):
        f.check()


@pytest.mark.parametrize("formats", [(4, 5, 4), (5, 4, 5)])
def test_a_publisher_moving_between_formats_4_and_5_keeps_followers_on_deltas(tmp_path, formats):
    """Each publisher continues the store (restored from it) in its own format. The first version
    after a move names its base's state digest under its own definition, and a follower that
    held the base sums its state once under it, then goes on by deltas; a fresh follower and a
    checkpoint pull walk the mixed chain."""
    from nemo_dcr.checkpoint.sync import find_version
    state = _state(6)
    recv = {k: torch.zeros_like(v) for k, v in state.items()}
    f = Follower(LocalStore(tmp_path), recv)
    seen = []
    for i, fv in enumerate(formats):
        pub = Publisher(LocalStore(tmp_path), format_version=fv, chunk_elems=4096)
        for j in range(2):
            m = pub.publish(state).manifest
            want = 2 if fv == 5 else 1
            assert m.definition == want and m.target_digest == state_contrib(state, definition=want).hex()
            if m.base_digest is not None:  # the last version's state, under this one's definition
                assert m.base_digest == state_contrib(seen[-1][1], definition=want).hex()
            res = f.sync()
            assert [k for k, _ in res.steps] == (["keyframe"] if i == j == 0 else ["delta"]), (fv, j)
            assert_state(recv, state)
            seen.append((m.version, {k: v.clone() for k, v in state.items()}))
            _step(state, 20 + 2 * i + j)
    fresh = {k: torch.zeros_like(v) for k, v in state.items()}
    Follower(LocalStore(tmp_path), fresh).sync()
    assert_state(fresh, seen[-1][1])
    # every version of the mixed chain is found from its tensors, whatever its definition
    for version, tensors in seen:
        assert find_version(str(tmp_path), tensors) == version
    assert find_version(str(tmp_path), state) is None  # (the last step was not published)


def test_a_follower_at_a_format_4_version_pulls_format_5_versions_by_delta(tmp_path):
    """A follower that held a format-4 version before the move sums its state once under
    definition 2 (one pass), and its delta is checked against the base's definition-2 digest; a
    wrong held state is refused before anything is written."""
    state = _state(7)
    Publisher(LocalStore(tmp_path), format_version=4).publish(state)
    recv = {k: torch.zeros_like(v) for k, v in state.items()}
    f = Follower(LocalStore(tmp_path), recv)
    f.sync()
    pub = Publisher(LocalStore(tmp_path), format_version=5)
    for s in range(2):
        _step(state, 30 + s)
        pub.publish(state)
    calls = []
    real = state_contrib

    def counting(tensors, *a, definition=1, **k):
        calls.append(definition)
        return real(tensors, *a, definition=definition, **k)
    with mock.patch("nemo_dcr.sync.follower.state_contrib", counting):
        res = f.sync()
    assert [k for k, _ in res.steps] == ["delta", "delta"]
    assert calls == [2]  # one pass, under the new definition, before the first delta
    assert_state(recv, state)
    # a follower whose held format-4 state was scribbled on: refused at the base check
    Publisher(LocalStore(tmp_path / "b"), format_version=4).publish(state)
    other = {k: torch.zeros_like(v) for k, v in state.items()}
    g = Follower(LocalStore(tmp_path / "b"), other)
    g.sync()
    _step(state, 40)
    Publisher(LocalStore(tmp_path / "b"), format_version=5).publish(state)
    other["w"].view(-1)[3] += 1
    snapshot = {k: v.clone() for k, v in other.items()}
    with pytest.raises(BaseMismatchError, match="built on a state whose digest is"):
        g.sync()  # refused at the base check, under definition 2, before anything is written
    assert_state(other, snapshot)
    res = g.sync()  # the next sync rebuilds from the keyframe
    assert [k for k, _ in res.steps] == ["keyframe", "delta"]
    assert_state(other, state)


def test_a_state_digest_of_another_definition_is_never_added():
    a = StateDigest.from_hex(state_contrib({"x": torch.ones(3)}).hex(), 2)
    with pytest.raises(DcrError, match="definition 2 and one of definition 1"):
        _ = a + state_contrib({"x": torch.ones(3)})


def test_checkpoint_publish_and_pull_in_format_5(tmp_path):
    from nemo_dcr.checkpoint.sync import publish_checkpoint, pull_checkpoint, verify_checkpoint
    state = {k: v for k, v in _state(8).items() if v.numel()}
    src = tmp_path / "model.safetensors"
    save_file(state, str(src))
    store = str(tmp_path / "store")
    publish_checkpoint(store, str(src), format_version=5, signer=None)
    _step(state, 50)
    save_file(state, str(src))
    publish_checkpoint(store, str(src), format_version=5, signer=None)
    head, _ = read_head(LocalStore(store))
    assert head is not None and head.format == 5
    out = tmp_path / "pulled.safetensors"
    pull_checkpoint(store, str(out))
    version, digest = verify_checkpoint(store, str(out))
    assert version == 1 and digest == state_contrib(state, definition=2).hex()
    assert json.loads(LocalStore(store).get(head.manifest))["format"] == 5


def test_a_keyframe_after_a_move_that_could_not_rebuild_its_base_names_no_base_digest(tmp_path):
    """A format-5 publisher that cannot rebuild the format-4 base (an object of it lost) publishes
    the keyframe the error names: no rank holds the base to sum it under definition 2, and with no
    delta into the version there is nothing to check it against, so the manifest names no base
    digest (none of another definition); a follower takes the keyframe. Found by the chaos
    campaign with publishers moving between formats (seed 56, run 18)."""
    from nemo_dcr.errors import PublishError
    state = _state(9)
    store = LocalStore(tmp_path)
    m0 = Publisher(store, format_version=4).publish(state).manifest
    store.delete(m0.keyframe_parts[0].key)
    _step(state, 60)
    pub = Publisher(LocalStore(tmp_path), format_version=5)
    with pytest.raises(PublishError, match="publish\\(keyframe=True\\)"):
        pub.publish(state)
    m = pub.publish(state, keyframe=True).manifest
    assert (m.format, m.parts, m.base_version, m.base_digest) == (5, [], 0, None)
    assert m.target_digest == state_contrib(state, definition=2).hex()
    recv = {k: torch.zeros_like(v) for k, v in state.items()}
    assert [k for k, _ in Follower(LocalStore(tmp_path), recv).sync().steps] == ["keyframe"]
    assert_state(recv, state)
