"""Each part's checksum in its manifest: SHA-256 (manifest formats 1-3) or BLAKE3 (formats 4
and 5, the default from format-3 deltas; stores/checksums.py).

What must hold: the checksum a manifest names is that algorithm's hash of the object's bytes;
exactly one is named, the one the manifest's format says; a reader of formats 1-3 refuses
format 4 by its number before anything is applied; a damaged object is refused under either;
a relay keeps a part whose checksum it guessed wrong while the bytes arrived (it hashes the
file again), and a store may change algorithm between versions.
"""
from __future__ import annotations

import hashlib
import json
from unittest import mock

import blake3
import pytest
import torch

from dcr_testing import assert_state, zeros_like
from nemo_dcr.errors import CorruptObjectError, ManifestError
from nemo_dcr.stores import LocalStore
from nemo_dcr.sync.follower import Follower
from nemo_dcr.sync.publisher import Publisher
from nemo_dcr.sync.versions import canonical_sha256, read_head, read_manifest


def model(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(64, 96, generator=g).to(torch.bfloat16) for i in range(4)}


def stepped(state: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(100 + seed)
    out = {k: v.clone() for k, v in state.items()}
    for v in out.values():
        flat = v.view(-1)
        idx = torch.randperm(flat.numel(), generator=g)[: flat.numel() // 50]
        flat[idx] = (flat[idx].float() + 0.01).to(v.dtype)
    return out


@pytest.mark.parametrize("kwargs, fmt, algo", [
    ({}, 5, "blake3"),                                          # the default
    ({"format_version": 4}, 4, "blake3"),                       # while format-4 receivers follow
    ({"object_checksum": "sha256"}, 3, "sha256"),               # while format-3 receivers follow
    ({"format_version": 2}, 2, "sha256"),                       # format-2 receivers: their checksum
])
def test_each_part_names_its_checksum_of_the_bytes(tmp_path, kwargs, fmt, algo):
    store = LocalStore(tmp_path / "s")
    pub = Publisher(store, part_bytes=16 << 10, delta_part_bytes=16 << 10, signer=None, **kwargs)
    v0 = model()
    v1 = stepped(v0, 1)
    pub.publish(v0)
    m = pub.publish(v1, keyframe=True).manifest
    head, _ = read_head(store)
    assert m.format == head.format == fmt and len(m.parts) > 1 and m.keyframe_parts
    other = {"sha256": "blake3", "blake3": "sha256"}[algo]
    h = {"sha256": hashlib.sha256, "blake3": blake3.blake3}[algo]
    stored = json.loads(store.get(m.key))
    for p, sp in zip(m.parts + m.keyframe_parts, stored["parts"] + stored["keyframe_parts"]):
        blob = store.get(p.key)
        assert (p.algo, p.checksum, p.size) == (algo, h(blob).hexdigest(), len(blob))
        assert sp[algo] == p.checksum and other not in sp  # the other's key is not stored at all
    recv = zeros_like(v0)
    assert Follower(store, recv).sync().version == 1
    assert_state(recv, v1)


def test_an_unknown_or_unreadable_choice_is_refused_before_anything_is_written(tmp_path):
    a, b = LocalStore(tmp_path / "a"), LocalStore(tmp_path / "b")
    with pytest.raises(ValueError, match="needs format_version 3"):
        Publisher(a, format_version=2, object_checksum="blake3")
    with pytest.raises(ValueError, match="one of sha256, blake3"):
        Publisher(b, object_checksum="md5")
    assert a.list("") == b.list("") == []


def two_versions(tmp_path):
    """A format-4 store with versions 0 and 1 -> (store, version 1's manifest, v0)."""
    store = LocalStore(tmp_path / "s")
    pub = Publisher(store, signer=None, format_version=4)
    v0 = model()
    pub.publish(v0)
    return store, pub.publish(stepped(v0, 1)).manifest, v0


def test_a_reader_of_formats_1_to_3_refuses_format_4_and_applies_nothing(tmp_path):
    store, m, v0 = two_versions(tmp_path)
    recv = {k: v.clone() for k, v in v0.items()}
    held = read_manifest(store, m.base_manifest)
    with mock.patch("nemo_dcr.sync.versions._READABLE", (1, 2, 3)):  # the release before format 4
        with pytest.raises(ManifestError, match="HEAD format 4 is not supported"):
            Follower(store, recv, manifest=held, verify_initial=False).sync()
        with pytest.raises(ManifestError, match="manifest format 4 is not supported"):
            read_manifest(store, m.key)
    assert_state(recv, v0)


def _resealed(store, key: str, edit) -> None:
    d = json.loads(store.get(key))
    edit(d)
    d.pop("checksum")
    d["checksum"] = canonical_sha256(d)
    store.put(key, json.dumps(d).encode())


@pytest.mark.parametrize("edit, why", [
    (lambda p: p.update(sha256=hashlib.sha256(b"x").hexdigest()), "names each part's blake3, not its sha256"),
    (lambda p: p.update(sha256=p.pop("blake3")), "names each part's blake3, not its sha256"),
    (lambda p: p.pop("blake3"), "blake3 must be 64 lowercase hex digits"),
    (lambda p: p.update(blake3=p["blake3"].upper()), "blake3 must be 64 lowercase hex digits"),
])
def test_a_format_4_part_names_its_blake3_and_nothing_else(tmp_path, edit, why):
    """Resealed edits (the manifest's own checksum fixed): a part naming both checksums, or the
    other format's, would let an edit choose which one a reader checks."""
    store = LocalStore(tmp_path / "s")
    m = Publisher(store, signer=None).publish(model()).manifest
    _resealed(store, m.key, lambda d: edit(d["keyframe_parts"][0]))
    with pytest.raises(ManifestError, match=why):
        read_manifest(store, m.key)


def test_a_format_3_part_names_its_sha256(tmp_path):
    store = LocalStore(tmp_path / "s")
    m = Publisher(store, signer=None, object_checksum="sha256").publish(model()).manifest
    _resealed(store, m.key, lambda d: d["keyframe_parts"][0].update(blake3="0" * 64))
    with pytest.raises(ManifestError, match="names each part's sha256, not its blake3"):
        read_manifest(store, m.key)


def test_a_damaged_object_is_refused_naming_its_checksum(tmp_path):
    store, m, v0 = two_versions(tmp_path)
    blob = bytearray(store.get(m.parts[0].key))
    blob[len(blob) // 2] ^= 0x10
    store.put(m.parts[0].key, bytes(blob))
    recv = {k: v.clone() for k, v in v0.items()}
    f = Follower(store, recv, manifest=read_manifest(store, m.base_manifest), verify_initial=False,
                 retries=1, backoff=0.0, stream=False)
    with pytest.raises(CorruptObjectError, match=f"{m.parts[0].key}.*with blake3 .*manifest says"):
        f.sync()
    assert_state(recv, v0)  # checked before anything of the version was applied


def test_a_relay_keeps_a_part_whose_checksum_changed_with_the_store(tmp_path):
    """A real relay process. It hashes a part's bytes as they arrive with the algorithm its
    manifest names, or, where that manifest is not known yet, the last manifest's. The store
    here changes algorithm (a trainer restarted on a newer release: format 3, then 4), and a
    part of the new version is asked for before the relay read the HEAD naming it: the relay
    hashes it again once the manifest says BLAKE3, and keeps it."""
    pytest.importorskip("aiohttp")
    from dcr_testing.relay import RelayProc
    from nemo_dcr.stores import HttpStore

    store_dir = tmp_path / "store"
    old = Publisher(str(store_dir), signer=None, object_checksum="sha256")
    v0 = model()
    v1 = stepped(v0, 1)
    old.publish(v0)
    m1 = old.publish(v1).manifest
    relay = RelayProc(str(store_dir), "--poll-interval", "120")  # no HEAD polls of its own in the test
    try:
        recv = {k: v.clone() for k, v in v0.items()}
        f = Follower(relay.url, recv, manifest=read_manifest(LocalStore(store_dir), m1.base_manifest),
                     verify_initial=False, speculate=False)
        assert f.sync().version == 1  # the relay read HEAD: format 3, SHA-256
        assert_state(recv, v1)

        v2 = stepped(v1, 2)
        m2 = Publisher(str(store_dir), signer=None).publish(v2).manifest  # restarted: format 5
        assert m2.format == 5 and m2.parts[0].algo == "blake3"
        key = m2.parts[0].key
        want = LocalStore(store_dir).get(key)
        http = HttpStore(relay.url)
        assert http.get(key) == want  # fetched before the relay read the HEAD naming it
        assert http.get(key) == want  # ... and served from its cache: kept
        st = http.stats()
        assert st["upstream_fetches_by_key"].get(key) == 1 and st["bad_objects"] == 0, st
        assert f.sync().version == 2
        assert_state(recv, v2)
    finally:
        relay.stop()


def test_the_cli_publishes_the_format_and_checksum_it_is_asked_for(tmp_path, capsys):
    """``nemo-dcr publish --format-version / --object-checksum``: a store receivers of an earlier
    release can follow, from the command line; a choice that cannot go together is refused
    before anything is read or written."""
    from safetensors.torch import save_file

    from dcr_testing.cli import run_cli
    from nemo_dcr.codec.format import DeltaReader
    states = [model(), stepped(model(), 1), stepped(stepped(model(), 1), 2)]
    for k, s in enumerate(states):
        save_file(s, str(tmp_path / f"m{k}.safetensors"))
    root = tmp_path / "s"
    r = run_cli(capsys, "publish", "--store", root, tmp_path / "m0.safetensors", "--format-version", 2,
                "--object-checksum", "blake3")
    assert r.returncode != 0 and "needs format_version 3" in r.stderr and "'sha256'" in r.stderr
    r = run_cli(capsys, "publish", "--store", root, tmp_path / "m0.safetensors", "--object-checksum", "md5")
    assert r.returncode != 0 and "invalid choice: 'md5'" in r.stderr
    assert not root.exists()  # nothing written
    store = LocalStore(root)
    for k, args, fmt, algo, version in [(0, ["--format-version", 2], 2, "sha256", 2),
                                        (1, ["--object-checksum", "sha256"], 3, "sha256", 4),
                                        (2, [], 5, "blake3", 5)]:
        r = run_cli(capsys, "publish", "--store", root, tmp_path / f"m{k}.safetensors", *args)
        assert r.returncode == 0, r.stderr
        m = read_manifest(store, read_head(store)[0].manifest)
        parts = m.parts + m.keyframe_parts
        assert (m.version, m.format) == (k, fmt) and parts
        assert {p.algo for p in parts} == {algo}
        assert {DeltaReader.open(store.get(p.key)).version for p in parts} == {version}
    # `log` says which format (so which releases can follow) and checksum each version has
    log = json.loads(run_cli(capsys, "log", "--store", root, "--json").stdout)
    assert [(r["version"], r["format"], r["checksum"]) for r in log] == [(2, 5, "blake3"), (1, 3, "sha256"),
                                                                         (0, 2, "sha256")]
    recv = zeros_like(states[0])
    f = Follower(store, recv)
    for k, s in enumerate(states):
        assert f.sync(k).version == k
        assert_state(recv, s)
