"""`nemo-dcr pull` at the edges a new user meets (issue 22): tensors without elements, output
spellings, Hugging Face model directories, signed stores pulled again and again."""
import hashlib
import os

import torch

from nemo_dcr.checkpoint.safetensors_io import Checkpoint, save_sharded


def files_sha(path):
    h = hashlib.sha256()
    for n in sorted(os.listdir(path)):
        if n.endswith(".safetensors") or n.endswith(".json"):
            h.update(n.encode() + open(os.path.join(path, n), "rb").read())
    return h.hexdigest()


def test_a_version_adding_a_tensor_without_elements_is_pulled_into_an_existing_checkpoint(tmp_path, cli):
    """A 0-element tensor adds nothing to the state digest, so the checkpoint at version 0 has
    version 1's digest too: the pull must still bring it (and every later version) to the
    version's files, also after a new keyframe."""
    g = torch.Generator().manual_seed(0)
    v0 = {"w": torch.randn(16, 8, generator=g)}
    v1 = {**v0, "e": torch.zeros(0, 4, dtype=torch.bfloat16)}
    v2 = {**v1, "w": v1["w"].clone()}
    v2["w"][1, 1] += 1
    v3 = {**v2, "w": v2["w"].clone()}
    v3["w"][2, 2] += 1
    cks = []
    for i, s in enumerate((v0, v1, v2, v3)):
        save_sharded(s, str(tmp_path / f"c{i}"))
        cks.append(tmp_path / f"c{i}")
    store, out = tmp_path / "store", tmp_path / "out"
    assert cli("publish", "--store", store, cks[0]).returncode == 0
    assert cli("pull", "--store", store, "--into", out).returncode == 0
    assert cli("publish", "--store", store, cks[1]).returncode == 0
    r = cli("pull", "--store", store, "--into", out)
    assert r.returncode == 0, r.stderr
    assert files_sha(out) == files_sha(cks[1]) and "e" in Checkpoint(str(out))

    stale = tmp_path / "stale"  # still at version 0 when the next versions come
    assert cli("pull", "--store", store, "--into", stale, "--version", "0").returncode == 0
    assert "e" not in Checkpoint(str(stale))
    assert cli("publish", "--store", store, cks[2]).returncode == 0
    r = cli("pull", "--store", store, "--into", stale)
    assert r.returncode == 0, r.stderr
    assert files_sha(stale) == files_sha(cks[2])
    assert cli("publish", "--store", store, cks[3], "--keyframe").returncode == 0
    for o in (out, stale):
        r = cli("pull", "--store", store, "--into", o)
        assert r.returncode == 0, r.stderr
        assert files_sha(o) == files_sha(cks[3])
