"""verl: nemo-dcr as a checkpoint engine (verl's weight-sync interface between the actor and the
rollout replicas), registered in verl's ``CheckpointEngineRegistry`` as ``dcr``.

    # verl config: the module is imported by verl's own plugin hook, then the backend is chosen by name
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=nemo_dcr.integrations.verl_engine
    actor_rollout_ref.rollout.checkpoint_engine.backend=dcr
    actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.dcr.store=s3://bucket/run1

verl's ``CheckpointEngineManager.update_weights`` runs, on every actor worker, ``send_weights``
with the training engine's ``get_per_tensor_param()`` (whole Hugging Face tensors, gathered by
the engine: FSDP, Megatron, ...), and on every rollout worker ``receive_weights``, whose
``(name, tensor)`` pairs it hands to the inference server's ``update_weights``. Here the store
is the transport (no NCCL group, nothing to exchange in ``prepare``):

* **actor** (``send_weights``): every rank iterates the generator (the engine's per-tensor
  gathers are collectives); actor rank 0 keeps a CPU copy of each tensor (cast to ``dtype``
  when given) and publishes them as the next version (``step=global_steps``): a delta against
  the last published version, committed before ``send_weights`` returns. Its metrics
  (``dcr/version``, ``dcr/bytes``, ``dcr/change_rate``, ``dcr/publish_s``) are what verl merges
  into the step's metrics.
* **rollout** (``receive_weights``): a ``Follower`` keeps a verified CPU mirror of the published
  state; it waits (up to ``timeout_s``) for the version of ``global_steps``, brings the mirror
  there bit-exactly (deltas, or a keyframe the first time), and yields only the tensors the
  update changed (all of them the first time): the server loads those with its own loader
  (vLLM's ``load_weights``). Every rollout worker pulls for itself (object storage fans out; a
  relay tree, ``nemo-dcr relay``, spares the origin).

``wire_format`` is ``named_tensors`` (whole tensors), which every verl rollout adapter takes.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

import torch

from nemo_dcr.errors import DcrError
from nemo_dcr.util.extras import require

require("verl.checkpoint_engine.base", "verl", "the verl checkpoint engine")
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry  # noqa: E402
from verl.workers.rollout.utils import ensure_async_iterator  # noqa: E402

from .snapshot import parse_dtype  # noqa: E402


@CheckpointEngineRegistry.register("dcr")
class DcrCheckpointEngine(CheckpointEngine):
    """verl checkpoint engine over a nemo-dcr store (see the module doc).

    Args:
        bucket_size: verl's bucket size (given to every engine; unused: whole tensors are published).
        store: the store URL (``s3://bucket/prefix``, a directory, a relay ``http://...`` for receivers).
        dtype: publish floating-point tensors in this dtype (None: as the engine exports them).
        keyframe_every: also store the full state every K versions (0: only the first).
        timeout_s: how long a rollout worker waits for the actor's version of ``global_steps``.
        publisher: further ``Publisher`` arguments (``retain``, ``encoding``, ``level``, ...).
    """

    wire_format = "named_tensors"

    def __init__(self, bucket_size: int = 0, store: str | None = None, dtype: str | None = None,
                 keyframe_every: int = 0, timeout_s: float = 600.0, publisher: dict | None = None, **kwargs):
        if not store:
            raise DcrError("the dcr checkpoint engine needs a store: checkpoint_engine.engine_kwargs.dcr.store=URL")
        parse_dtype(dtype)
        self.bucket_size, self.store, self.dtype = int(bucket_size), store, dtype
        self.keyframe_every, self.timeout_s = int(keyframe_every), float(timeout_s)
        self.publisher_kwargs = dict(publisher or {})
        self.rank: int | None = None
        self.role: str | None = None
        self._publisher: Any = None        # actor rank 0
        self._follower: Any = None         # rollout workers
        self.tensors: dict[str, torch.Tensor] = {}  # a rollout worker's verified mirror of the published state

    # ------------------------------------------------------------------ topology (the store is the transport)
    def prepare(self) -> dict[str, Any]:
        return {}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]):
        return ({"rank": list(range(actor_wg_world_size)), "role": ["actor"] * actor_wg_world_size},
                {"rank": list(range(rollout_world_size)), "role": ["rollout"] * rollout_world_size})

    def init_process_group(self, rank: int = 0, role: str = "actor", **kwargs):
        self.rank, self.role = int(rank), role
        if role == "actor" and self.rank == 0:
            # the publisher (which creates a local store: a reader refuses a missing one) before any
            # rollout worker reads: verl's manager inits every worker before the first update
            self._open_publisher()

    def finalize(self):
        pass

    # ------------------------------------------------------------------ actor
    async def send_weights(self, weights, global_steps: int | None = None) -> dict:
        publishes = self.rank in (None, 0)
        dt = parse_dtype(self.dtype)
        tensors: dict[str, torch.Tensor] = {}
        async for name, t in ensure_async_iterator(weights):  # every rank: the gathers are collectives
            if publishes:
                t = t.detach()
                cast = dt if dt is not None and t.is_floating_point() else t.dtype
                tensors[name] = t.to(device="cpu", dtype=cast, copy=True)
        if not publishes:
            return {}
        return await asyncio.to_thread(self._publish, tensors, global_steps)

    def _open_publisher(self):
        from nemo_dcr.sync.publisher import Publisher
        if self._publisher is None:
            self._publisher = Publisher(self.store, keyframe_every=self.keyframe_every, **self.publisher_kwargs)
        return self._publisher

    def _publish(self, tensors: dict, step: int | None) -> dict:
        r = self._open_publisher().publish(tensors, step=step)
        return {"dcr/version": float(r.version), "dcr/bytes": float(r.delta_bytes + r.keyframe_bytes),
                "dcr/change_rate": float(r.change_rate), "dcr/publish_s": float(r.seconds)}

    # ------------------------------------------------------------------ rollout
    async def receive_weights(self, global_steps: int | None = None):
        changed = await asyncio.to_thread(self._pull, global_steps)
        for name in changed:
            yield name, self.tensors[name]

    def _pull(self, step: int | None) -> list[str]:
        """Bring the mirror to the version published for ``step`` (the newest, and at least that
        step); the names of the tensors that changed, in the mirror's order."""
        from nemo_dcr.sync.follower import Follower
        if self._follower is None:
            self._follower = Follower(self.store, self.tensors)
        f = self._follower
        before = {n: t._version for n, t in self.tensors.items()}
        deadline = time.monotonic() + self.timeout_s
        head = f.read_head()
        while True:
            if head is not None:
                f.sync(head=head)
                got = f.manifest.step if f.manifest is not None else None
                if step is None or (got is not None and got >= step):
                    break
            left = deadline - time.monotonic()
            head = f.wait(newer_than=f.version, timeout=left) if left > 0 else None
            if head is None:
                raise DcrError(f"no version for step {step} in {self.store} within {self.timeout_s:.0f} s "
                               f"(the newest held: {f.version})")
        return [n for n, t in self.tensors.items() if before.get(n) != t._version]


__all__ = ["DcrCheckpointEngine"]
