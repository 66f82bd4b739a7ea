"""The few collectives the publisher and follower need, over the caller's own process group
(the trainer's, or the rollout cluster's). Nothing here ever crosses clusters. Without an
initialised torch.distributed, everything is single-process."""
from __future__ import annotations

import torch
import torch.distributed as dist


class Group:
    def __init__(self, group=None):
        self.group = group
        self.active = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if self.active else 0
        self.world_size = dist.get_world_size(group) if self.active else 1
        if self.world_size == 1:
            self.active = False

    def all_gather(self, obj) -> list:
        if not self.active:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj, src: int = 0):
        if not self.active:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self._global(src), group=self.group)
        return box[0]

    def all_ok(self, ok: bool) -> bool:
        """True only when every rank says True."""
        if not self.active:
            return ok
        t = torch.tensor([1 if ok else 0], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return bool(t.item())

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank
