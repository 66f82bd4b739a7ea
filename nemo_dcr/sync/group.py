"""The few collectives the publisher and follower need, over the caller's own process group
(the trainer's, or the rollout cluster's). Nothing here ever crosses clusters. Without an
initialised torch.distributed, everything is single-process.

One way to fail across ranks: :meth:`Group.run` runs a step on every rank, gathers every rank's
outcome, and when any rank raised, raises *the same* typed error on every rank, naming which
ranks failed and why (as ``torch.distributed.checkpoint``'s ``CheckpointException`` does). So no
rank walks on into a collective that a failed rank never joins (a hang until the group's
timeout, or collectives paired wrongly), and every rank takes the same recovery path.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.distributed as dist

from nemo_dcr.errors import DcrError, GroupError, RankFailure

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

T = TypeVar("T")


class Group:
    def __init__(self, group: ProcessGroup | None = None):
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

    def run(self, fn: Callable[[], T], what: str, *, error: type | None = None, src: int | None = None,
            gather: bool = False, note: str = ""):
        """``fn()`` on every rank; if it raises on any rank, raise on every rank.

        Returns this rank's result, or with ``src=r`` rank r's result on every rank (the others'
        ``fn`` may return None: only rank r's result travels), or with ``gather=True`` the list
        of every rank's result. The error raised when some ranks failed:

        * of class ``error`` if given; else of the class every failed rank raised, if they all
          raised the same ``DcrError`` subclass; else ``GroupError``;
        * its message is ``"<what> failed: rank 2: OSError: ...; rank 3: ..."`` (+ ``note``);
        * ``rank_failures`` maps each failed rank to its ``RankFailure`` (class, message); an
          error that was itself raised by a nested ``run`` contributes its own failures;
        * on a rank that failed, its own exception is the ``__cause__``.

        Only ``Exception`` is caught: a rank that dies or is interrupted breaks the collective
        (the backend reports that), which is all a group can do about it.
        """
        value, exc = None, None
        try:
            value = fn()
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            exc = e
        if not self.active:
            if exc is None:
                return [value] if gather else value
            if error is None or isinstance(exc, error):
                raise exc  # no other rank to tell: the error as it is
            failures = _failures_of(exc, 0)
        else:
            mine = _failures_of(exc, self.rank) if exc is not None else None
            send = value if exc is None and (gather or src == self.rank) else None
            outs = self.all_gather((mine, send))
            failures = {}
            for f, _ in outs:
                failures.update(f or {})
            if not failures:
                if gather:
                    return [v for _, v in outs]
                return outs[src][1] if src is not None else value
        err = _group_error(what, failures, error, note)
        if exc is not None:
            raise err from exc
        raise err from None

    def all_gather_bytes(self, mine: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        """Every rank's 1-D uint8 tensor; ``sizes``: each rank's length, known to every rank (one
        exchange, no size round; the shorter ones are padded to the longest on the wire)."""
        if not self.active:
            return [mine]
        n = max(sizes)
        buf = torch.zeros(n, dtype=torch.uint8)
        buf[: mine.numel()] = mine
        out = [torch.empty(n, dtype=torch.uint8) for _ in range(self.world_size)]
        dist.all_gather(out, buf, group=self.group)
        return [o[:s] for o, s in zip(out, sizes)]

    def broadcast(self, obj, src: int = 0):
        if not self.active:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self._global(src), group=self.group)
        return box[0]

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank


def _failures_of(exc: BaseException, rank: int) -> dict:
    inner = getattr(exc, "rank_failures", None)
    if isinstance(inner, dict) and inner:
        return dict(inner)  # already a group's verdict (a nested run): keep the ranks that failed
    cls = type(exc)
    return {rank: RankFailure(cls.__module__, cls.__qualname__, str(exc))}


def _resolve(f: RankFailure):
    try:
        obj = importlib.import_module(f.module)
        for part in f.qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return None
    return obj if isinstance(obj, type) and issubclass(obj, BaseException) else None


def _group_error(what: str, failures: dict, error: type | None, note: str) -> DcrError:
    """The same error on every rank: built from the gathered failures alone."""
    cls = error
    if cls is None:
        kinds = {(f.module, f.qualname) for f in failures.values()}
        one = _resolve(next(iter(failures.values()))) if len(kinds) == 1 else None
        cls = one if one is not None and issubclass(one, DcrError) else GroupError
    msg = f"{what} failed: " + "; ".join(f"rank {r}: {f.qualname}: {f.message}" for r, f in sorted(failures.items()))
    if note:
        msg += f" ({note})"
    return _instance(cls, msg, failures)


def _instance(cls: type[DcrError], msg: str, failures: dict) -> DcrError:
    try:
        err = cls(msg)
        ok = str(err) == msg
    except Exception:  # noqa: BLE001 - a constructor that takes other arguments
        ok = False
    if not ok:  # e.g. NotFound(key): keep the class, set the message
        err = cls.__new__(cls)
        err.args = (msg,)
    # any DcrError class carries it here, not only GroupError (which declares it)
    err.rank_failures = dict(failures)  # type: ignore[attr-defined]
    return err
