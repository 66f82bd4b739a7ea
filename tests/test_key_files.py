"""Key and token files named on the command line (issue 22): a FIFO is refused instead of
blocking forever (as checkpoint and delta inputs are), a private key others may read is refused
(as ssh refuses one), and `pull --token-file` reaches a relay that wants a token."""
import os
import threading

import pytest
import torch
from safetensors.torch import save_file

from dcr_testing.relay import RelayProc
from nemo_dcr.sync.signing import generate_key, private_key_pem, public_key_text

pytest.importorskip("cryptography")

KEY = generate_key()


def run_bounded(cli, *args, limit=60.0):
    """``cli(*args)`` on a thread: a command that blocks on a FIFO fails the test (and is
    released by opening the FIFOs for writing) instead of hanging the suite."""
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", cli(*args)), daemon=True)
    t.start()
    t.join(limit)
    if t.is_alive():
        for a in args:
            if isinstance(a, str) and os.path.exists(a) and not os.path.isfile(a) and not os.path.isdir(a):
                try:  # a writer (closed at once) lets the blocked reader see end of file
                    os.close(os.open(a, os.O_WRONLY | os.O_NONBLOCK))
                except OSError:
                    pass
        t.join(30)
        pytest.fail(f"nemo-dcr {' '.join(map(str, args))} blocked on a FIFO")
    return out["r"]


@pytest.fixture
def signed_store(tmp_path, cli):
    save_file({"w": torch.arange(12.0)}, str(tmp_path / "m.safetensors"))
    key = tmp_path / "run.key"
    key.write_bytes(private_key_pem(KEY))
    key.chmod(0o600)
    (tmp_path / "run.key.pub").write_text(public_key_text(KEY) + "\n")
    r = cli("publish", "--store", tmp_path / "store", "--signing-key", key, "--namespace", "run",
            tmp_path / "m.safetensors")
    assert r.returncode == 0, r.stderr
    return tmp_path / "store"


def test_a_fifo_as_a_key_or_token_file_is_an_error_not_a_hang(tmp_path, cli, signed_store):
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    cases = {
        "--signing-key": ("publish", "--store", str(signed_store), "--signing-key", fifo, "--namespace", "run",
                          str(tmp_path / "m.safetensors")),
        "--trusted-key": ("pull", "--store", str(signed_store), "--into", str(tmp_path / "o1"), "--trusted-key", fifo),
        "--token-file": ("relay", "--listen", "127.0.0.1:0", "--upstream", str(signed_store), "--token-file", fifo),
        "pull --token-file": ("pull", "--store", "http://127.0.0.1:9", "--into", str(tmp_path / "o2"),
                              "--token-file", fifo),
    }
    for what, args in cases.items():
        r = run_bounded(cli, *args)
        assert r.returncode == 1, (what, r.stderr)
        assert "FIFO" in r.stderr and "regular file" in r.stderr and fifo in r.stderr, (what, r.stderr)
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


@pytest.mark.parametrize("mode", [0o644, 0o666, 0o640, 0o604])
def test_a_private_key_others_may_read_is_refused(tmp_path, cli, signed_store, mode):
    key = tmp_path / "run.key"
    key.chmod(mode)
    before = sorted(os.listdir(signed_store / "versions"))
    r = cli("publish", "--store", signed_store, "--signing-key", key, "--namespace", "run", tmp_path / "m.safetensors")
    assert r.returncode == 1
    assert f"{mode:04o}" in r.stderr and "chmod 600" in r.stderr and str(key) in r.stderr, r.stderr
    assert sorted(os.listdir(signed_store / "versions")) == before  # nothing published
    os.environ["NEMO_DCR_SIGNING_KEY_FILE"] = str(key)  # the environment's key file: the same rule
    try:
        from nemo_dcr.errors import SignatureError
        from nemo_dcr.sync.signing import Signer
        with pytest.raises(SignatureError, match="chmod 600"):
            Signer.from_env("run")
    finally:
        del os.environ["NEMO_DCR_SIGNING_KEY_FILE"]
    key.chmod(0o400)  # the owner alone: fine
    r = cli("publish", "--store", signed_store, "--signing-key", key, "--namespace", "run", tmp_path / "m.safetensors")
    assert r.returncode == 0, r.stderr


def test_pull_log_verify_take_a_token_file_for_a_relay(tmp_path, cli, signed_store):
    (tmp_path / "token").write_text("s3cret-token\n")
    relay = RelayProc(str(signed_store), "--token-file", tmp_path / "token")
    try:
        r = cli("pull", "--store", relay.url, "--into", tmp_path / "o.safetensors")
        assert r.returncode == 1 and "token" in r.stderr.lower(), r.stderr
        r = cli("pull", "--store", relay.url, "--into", tmp_path / "o.safetensors", "--token-file", tmp_path / "token",
                "--trusted-key", tmp_path / "run.key.pub")
        assert r.returncode == 0, r.stderr
        assert (tmp_path / "o.safetensors").read_bytes() == (tmp_path / "m.safetensors").read_bytes()
        r = cli("log", "--store", relay.url, "--token-file", tmp_path / "token")
        assert r.returncode == 0 and "keyframe" in r.stdout, r.stderr
        r = cli("verify", "--store", relay.url, "--token-file", tmp_path / "token", tmp_path / "o.safetensors")
        assert r.returncode == 0 and "is version 0" in r.stdout, r.stderr
    finally:
        relay.stop()
    r = cli("pull", "--store", signed_store, "--into", tmp_path / "x", "--token-file", tmp_path / "token")
    assert r.returncode == 1 and "relay" in r.stderr
