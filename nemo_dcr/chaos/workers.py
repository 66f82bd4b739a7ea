"""The chaos harness's long-lived worker processes, driven by commands over a pipe.

* ``publisher_main``: one rank of the trainer group (gloo). ``open`` makes a fresh
  ``Publisher`` on a store; ``publish`` publishes content ``(epoch, c)`` (the rank's shard of
  :mod:`nemo_dcr.chaos.truth`'s state) with ``meta={"chaos": [epoch, c]}``.
* ``follower_main``: one receiver. ``open`` makes a fresh ``RolloutLoader`` over an HF-style
  ``torch.nn.Module`` on the store the harness names (directly, a relay, or a fallback list).
  ``update`` brings it to the newest version and answers with the version it reports, the
  manifest it holds, the error it raised, and the raw bytes of what the engine would now sample
  from (the module's tensors, read under ``sampling()``).

Processes are forked from a fork server that imported torch once, so killing one and starting
another costs a fork, not an import.
"""
from __future__ import annotations

import datetime
import os
import time
import traceback
from typing import TYPE_CHECKING

import torch

from nemo_dcr.chaos import truth

if TYPE_CHECKING:
    from nemo_dcr.integrations.rollout import RolloutLoader

PRELOAD = ["torch", "torch.distributed", "boto3", "nemo_dcr.chaos.truth", "nemo_dcr.stores",
           "nemo_dcr.sync.publisher", "nemo_dcr.sync.follower", "nemo_dcr.integrations.rollout"]
# a dead peer is noticed at once (closed sockets); the timeout is the backstop, long enough for
# ranks starved of CPU on a shared machine
GLOO_TIMEOUT = datetime.timedelta(seconds=60)
BACKOFF_S = 0.02


_STORES: dict = {}


def open_store(spec, cache: bool = False):
    """A store from the harness's spec: ``{"kind": "local", "root"}``, ``{"kind": "s3", "bucket",
    "prefix", "endpoint"}``, ``{"kind": "http", "url"}`` or ``{"kind": "list", "of": [...]}``.
    Retries are short: faults are frequent here and a run must not wait out AWS-sized backoffs.
    ``cache``: a long-lived worker reuses the S3 store it opened for the same spec in an earlier
    run (making a boto3 client costs ~0.5 s of CPU; the store keeps no state between requests but
    its connections). Other stores are cheap and made afresh (a fallback list remembers which
    source failed; a local store checks its directory when opened)."""
    from nemo_dcr.stores import FallbackStore, HttpStore, LocalStore, S3Store
    k = spec["kind"]
    if k == "list":
        return FallbackStore([open_store(s, cache) for s in spec["of"]], retry_after=1.0)
    if cache and k == "s3":
        key = repr(sorted(spec.items()))
        if key not in _STORES:
            _STORES[key] = open_store(spec)
        return _STORES[key]
    if k == "local":
        return LocalStore(spec["root"], create=spec.get("create", False))
    if k == "s3":
        return S3Store(spec["bucket"], spec["prefix"], endpoint_url=spec["endpoint"], max_attempts=3, retries=3,
                       backoff_base=0.02, backoff_max=0.2, connect_timeout=2, read_timeout=10)
    if k == "http":
        return HttpStore(spec["url"], timeout=15, connect_timeout=2)
    raise ValueError(k)


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:500]


# ----------------------------------------------------------------------------- publisher

def publisher_main(rank: int, port: int, conn, env: dict) -> None:
    import torch.distributed as dist

    from nemo_dcr.sync.publisher import Publisher

    os.environ.update(env)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=truth.WORLD,
                            timeout=GLOO_TIMEOUT)
    state: dict = {"layout": truth.shard_layout(rank)}
    bases: dict = {}  # checkpoint -> its tensors (engine mode): read once per process

    def open_(cmd):
        signer = None
        if cmd.get("signing_key"):  # a signed campaign: this run's namespace
            from nemo_dcr.sync.signing import Signer, load_private_key
            signer = Signer(load_private_key(cmd["signing_key"]), cmd["namespace"])
        base = None
        if cmd.get("base"):  # engine mode: the engine's checkpoint is the base of every epoch
            if cmd["base"] not in bases:
                bases[cmd["base"]] = truth.load_base(cmd["base"])
            base = bases[cmd["base"]]
        state["layout"] = truth.shard_layout(rank, None if base is None else {n: t.shape for n, t in base.items()})
        state["contents"] = truth.Contents(cmd["seed"], base)
        state["pub"] = Publisher(open_store(cmd["store"], cache=True), keyframe_every=cmd["keyframe_every"],
                                 retain=cmd["retain"], chunk_elems=cmd.get("chunk_elems", 256), signer=signer,
                                 **({"format_version": cmd["format_version"]} if "format_version" in cmd else {}))
        return {}

    def publish(cmd):
        e, c = cmd["content"]
        st = truth.local_shard(state["contents"].state(e, c), state["layout"])
        state["contents"].forget_before(e, c)
        r = state["pub"].publish(st, state["layout"], keyframe=cmd.get("keyframe", False), step=c,
                                 meta={"chaos": [e, c]})
        return {"version": r.version, "key": r.manifest.key}

    serve(conn, {"open": open_, "publish": publish}, {"ready": rank})


def serve(conn, handlers: dict, hello: dict) -> None:
    """Answer commands until ``exit``: every reply is ``{"ok": True, ...}`` or ``{"ok": False,
    "error", "tb"}`` (the error is the worker's to report, the harness judges it)."""
    conn.send({"ok": True, **hello})
    while True:
        cmd = conn.recv()
        if cmd["op"] == "exit":
            os._exit(0)
        try:
            conn.send({"ok": True, **handlers[cmd["op"]](cmd)})
        except Exception as ex:
            conn.send({"ok": False, "error": _err(ex), "tb": traceback.format_exc()[-2000:]})


# ----------------------------------------------------------------------------- follower

class TinyLM(torch.nn.Module):
    """An HF-style module whose state_dict is truth.SHAPES: parameters of three dtypes and an
    integer buffer."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(64, 16, dtype=torch.bfloat16)
        self.proj = torch.nn.Linear(16, 32, dtype=torch.bfloat16)
        self.proj.bias = torch.nn.Parameter(torch.zeros(32))
        self.norm = torch.nn.Module()
        self.norm.weight = torch.nn.Parameter(torch.ones(16, dtype=torch.float16))
        self.register_buffer("ids", torch.zeros(8, dtype=torch.int32))
        with torch.no_grad():
            for p in self.parameters():
                p.zero_()


class _Receiver:
    def __init__(self, store_spec, sabotage: str | None, trusted: str | None = None, namespace: str | None = None):
        self.spec, self.sabotage = store_spec, sabotage
        self.trusted, self.namespace = trusted, namespace
        self.loader: RolloutLoader | None = None
        self.model: TinyLM | None = None
        self._last: object = None

    def _make_loader(self) -> RolloutLoader:
        from nemo_dcr.integrations.rollout import RolloutLoader
        model = self.model = TinyLM()
        hook = (lambda v, r: _flip_one_bit(model)) if self.sabotage == "flip-after-update" else None
        store = open_store(self.spec, cache=True)
        if self.trusted:  # a signed campaign: HEAD and every manifest checked as read, end to end
            from nemo_dcr.sync.signing import Verifier, load_public_keys
            store = Verifier(load_public_keys(self.trusted), self.namespace).wrap(store)
        self.loader = RolloutLoader(store, model, on_update=hook)
        # the follower's retry waits are short, as the stores' (open_store): faults are frequent
        # here; the number of attempts is the library's own
        self.loader.follower.backoff = BACKOFF_S
        return self.loader

    def update(self) -> dict:
        out: dict = {"version": None, "key": None, "error": None, "rekeyed": False, "fallbacks": 0}
        t0 = time.monotonic()
        try:
            (self.loader or self._make_loader()).update()
        except Exception as e:
            out["error"] = _err(e)
        if self.loader is not None and self.model is not None:
            out["version"] = self.loader.version
            m = self.loader.follower.manifest
            out["key"] = m.key if m is not None else None
            res = self.loader.last_result
            if res is not None and res is not self._last:  # a sync ran in this update
                out["rekeyed"], out["fallbacks"] = bool(res.rekeyed), len(res.fallbacks)
                self._last = res
            with self.loader.sampling():  # what the engine samples from
                out["raw"] = truth.raw_bytes({n: t for n, t in self.model.state_dict().items()})
        out["seconds"] = time.monotonic() - t0
        return out


def _flip_one_bit(model) -> None:
    """The harness's self-test (``--sabotage flip-after-update``), through the loader's public
    ``on_update`` seam: an engine write that goes wrong *after* the follower verified (what
    slime #2442 shipped). Only the harness's own bit comparison can see it."""
    from nemo_dcr.state.dtypes import int_view
    with torch.no_grad():
        int_view(model.proj.weight.data).view(-1)[3] ^= 1


def follower_main(conn, env: dict) -> None:
    os.environ.update(env)
    torch.set_num_threads(1)
    import logging
    logging.getLogger("nemo_dcr").setLevel(logging.ERROR)
    state: dict = {}

    def open_(cmd):
        state["rec"] = _Receiver(cmd["store"], cmd.get("sabotage"), cmd.get("trusted"), cmd.get("namespace"))
        return {}

    serve(conn, {"open": open_, "update": lambda cmd: state["rec"].update()}, {"pid": os.getpid()})
