"""Finding the version a checkpoint holds (``pull`` into an existing checkpoint, ``verify``) reads
the chain from HEAD down only as far as it must, and a damaged or foreign-signed manifest below
what it needs stops nothing (issue 22: it read the whole history on every pull, one manifest per
version ever published, and one damaged old manifest, or one signed by a rotated-out key, broke
every pull into an existing checkpoint and ``verify``)."""
import pytest
import torch
from safetensors.torch import load_file, save_file

from dcr_testing import assert_state
from nemo_dcr.checkpoint.sync import locate_checkpoint, publish_checkpoint, pull_checkpoint, verify_checkpoint
from nemo_dcr.state.statedigest import state_contrib
from nemo_dcr.stores import LocalStore
from nemo_dcr.sync.signing import Signer, Verifier, generate_key, verifying
from nemo_dcr.sync.versions import is_manifest_key, locate, read_head, walk


class CountingStore(LocalStore):
    """A local store that counts reads of manifests."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.manifest_reads = 0

    def get(self, key):
        self.manifest_reads += is_manifest_key(key)
        return super().get(key)


def states(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = {"w": torch.randn(64, 32, generator=g).bfloat16(), "b": torch.randn(32, generator=g)}
    out = []
    for i in range(n):
        out.append({k: t.clone() for k, t in s.items()})
        s["w"].view(torch.int16)[torch.rand(64, 32, generator=g) < 0.02] += 1
        s["b"][i % 32] += 1
    return out


def publish_all(store, tmp_path, chain, **kw):
    for i, s in enumerate(chain):
        src = tmp_path / f"v{i}.safetensors"
        save_file(s, str(src))
        publish_checkpoint(store, str(src), **kw)


def manifest_of(store, version):
    return next(m for m in walk(store, read_head(store)[0]) if m.version == version)


def corrupt(store, key):
    data = store.get(key)
    i = len(data) // 2
    store.put(key, data[:i] + bytes([data[i] ^ 0x04]) + data[i + 1:])


def test_a_damaged_old_manifest_stops_no_pull_into_a_checkpoint_above_it(tmp_path):
    store = LocalStore(tmp_path / "store")
    chain = states(6)
    publish_all(store, tmp_path, chain[:5], keyframe_every=2, signer=None)  # keyframes 0, 2, 4
    out = tmp_path / "out.safetensors"
    pull_checkpoint(store, str(out), version=3)
    corrupt(store, manifest_of(store, 1).key)
    src = tmp_path / "v5.safetensors"
    save_file(chain[5], str(src))
    publish_checkpoint(store, str(src), keyframe_every=2, signer=None)

    r = pull_checkpoint(store, str(out))  # before the fix: ManifestError from version 1
    assert r.sync.from_version == 3 and r.sync.steps == [("delta", 4), ("delta", 5)]
    assert_state(load_file(str(out)), chain[5])
    assert verify_checkpoint(store, str(out))[0] == 5
    # a checkpoint of a version below the damage: verify says so, it does not raise
    v0 = tmp_path / "v0.safetensors"
    found, _ = locate_checkpoint(store, str(v0))
    assert found.manifest is None and "versions/000000000001/" in found.ended and "checksum" in found.ended
    assert verify_checkpoint(store, str(v0))[0] is None


def test_finding_the_checkpoint_version_reads_recent_manifests_only(tmp_path):
    store = CountingStore(tmp_path / "store")
    chain = states(30)
    publish_all(store, tmp_path, chain[:29], signer=None)  # keyframe 0 and 28 deltas
    out = tmp_path / "out.safetensors"
    pull_checkpoint(store, str(out))
    src = tmp_path / "v29.safetensors"
    save_file(chain[29], str(src))
    publish_checkpoint(store, str(src), signer=None)

    store.manifest_reads = 0
    r = pull_checkpoint(store, str(out))
    assert r.sync.steps == [("delta", 29)]
    assert_state(load_file(str(out)), chain[29])
    # version 28 (the checkpoint's): 29's is carried in HEAD (format 3), for the search and for
    # the sync's target; format 2 read 29, 28, then 29 again; before that: all 30, then 29, 28, 29
    assert store.manifest_reads == 1
    store.manifest_reads = 0
    assert verify_checkpoint(store, str(out))[0] == 29
    assert store.manifest_reads == 0  # HEAD's, carried in HEAD


def test_a_checkpoint_of_no_recent_version_reads_no_further_than_a_keyframe_pays(tmp_path):
    # the deltas below the newest keyframe cost more than it within a few versions: a version
    # further down would be reached by that keyframe anyway, so the search ends there
    store = CountingStore(tmp_path / "store")
    chain = states(40, seed=1)
    publish_all(store, tmp_path, chain, keyframe_every=30, signer=None)  # keyframes 0 and 30
    stranger = tmp_path / "out.safetensors"
    save_file({"w": torch.zeros(64, 32).bfloat16(), "b": torch.zeros(32)}, str(stranger))
    found = locate(store, state_contrib(load_file(str(stranger))).hex(), worth_fetching=True)
    # 10 above the keyframe, 4 below it (format 3: deltas of ~1 KB against a keyframe of ~4.1 KB)
    assert found.manifest is None and found.read == 14 and "cost more than that keyframe" in found.ended
    store.manifest_reads = 0
    r = pull_checkpoint(store, str(stranger))
    assert r.sync.steps[0] == ("keyframe", 30) and r.sync.version == 39
    assert_state(load_file(str(stranger)), chain[39])
    # and the pull's own (version 39, the chain down to keyframe 30): before, 51; version 39's
    # manifest, HEAD's, is carried in HEAD (format 3) for both
    assert store.manifest_reads == (14 - 1) + (11 - 1)


def test_key_rotation_a_receiver_trusting_the_new_key_pulls_past_versions_of_the_old(tmp_path):
    store = LocalStore(tmp_path / "store")
    old, new = generate_key(), generate_key()
    chain = states(5, seed=2)
    publish_all(store, tmp_path, chain[:2], signer=Signer(old, "run-1"))
    src = tmp_path / "v2.safetensors"
    save_file(chain[2], str(src))
    # rotated: a keyframe, its publisher told to trust the old key (it builds on no chain it cannot verify)
    publish_checkpoint(store, str(src), keyframe=True, signer=Signer(new, "run-1"), trusted_keys=[old.public_key()])
    src = tmp_path / "v3.safetensors"
    save_file(chain[3], str(src))
    publish_checkpoint(store, str(src), signer=Signer(new, "run-1"))
    out = tmp_path / "out.safetensors"
    trusting_new = verifying(store, Verifier([new.public_key()], "run-1"))
    pull_checkpoint(trusting_new, str(out))
    src = tmp_path / "v4.safetensors"
    save_file(chain[4], str(src))
    publish_checkpoint(store, str(src), signer=Signer(new, "run-1"))

    trusting_new = verifying(store, Verifier([new.public_key()], "run-1"))
    r = pull_checkpoint(trusting_new, str(out))  # before the fix: SignatureError from version 1
    assert r.sync.from_version == 3 and r.sync.steps == [("delta", 4)]
    assert_state(load_file(str(out)), chain[4])
    assert verify_checkpoint(verifying(store, Verifier([new.public_key()], "run-1")), str(out))[0] == 4


@pytest.mark.parametrize("damaged", [3, 4])
def test_damage_between_head_and_the_checkpoint_falls_back_to_a_keyframe(tmp_path, damaged):
    store = LocalStore(tmp_path / "store")
    chain = states(6, seed=3)
    publish_all(store, tmp_path, chain[:3], keyframe_every=5, signer=None)
    out = tmp_path / "out.safetensors"
    pull_checkpoint(store, str(out))  # at version 2
    for i in (3, 4, 5):
        src = tmp_path / f"v{i}.safetensors"
        save_file(chain[i], str(src))
        publish_checkpoint(store, str(src), keyframe_every=5, signer=None)  # 5 is a keyframe
    corrupt(store, manifest_of(store, damaged).key)
    r = pull_checkpoint(store, str(out))  # the deltas from 2 are out of reach: keyframe 5
    assert r.sync.steps == [("keyframe", 5)]
    assert_state(load_file(str(out)), chain[5])
