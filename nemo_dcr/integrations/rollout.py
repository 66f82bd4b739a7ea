"""Rollout side: keep an inference model's weights at the newest published version, in place.

    loader = RolloutLoader("s3://bucket/run1", model)       # any torch.nn.Module, or a dict of tensors
    loader.update()                                         # -> the version the weights now hold
    with loader.sampling():                                 # never sample from half-updated weights
        out = model.generate(...)

The weights are changed in place (the module's own parameter storage: nothing is reallocated, so
CUDA graphs, compiled kernels and optimizers holding the parameters keep working) by
``nemo_dcr.follower.Follower``: every object is checked before the first write, and the state
after each version is verified against the digest the trainer committed.

Names: the receiver's tensors are named as in its ``state_dict`` (parameters and persistent
buffers, tied weights once), which matches what ``DeltaPublishCallback`` publishes for the
same model class. ``name_map`` maps *published* names to the receiver's names where they differ
(a dict, or a callable returning the receiver's name or None for "not held here"). Tensors the
receiver holds that the trainer does not publish are left alone.

Tensors on a GPU: by default (``staging="auto"``) the loader keeps a CPU copy of the receiver's
tensors (pinned when CUDA is available), applies each version to it and copies the tensors that
changed to the device: host memory of one copy of the weights, and each changed tensor's whole
bytes to the device per version. ``staging=False`` applies in place on the device instead:
each chunk is decoded on the host and only its changes cross (``delta/apply.py``), the checks
and the state-digest update run where the tensors are. A sharded engine's group does the same:
its ``classes`` chunks held in part are classed on the device and only per-run class counts and
the changes cross (``sync/chunk_gather.py``). Checked on CPU tensors by the tests (the device
route forced) and on a GPU by ``tests/gpu/run_gpu.py``.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Mapping, MutableMapping
from typing import TYPE_CHECKING

import torch

from nemo_dcr.errors import BaseMismatchError, DcrError
from nemo_dcr.state.index_map import ShardSpec

from .snapshot import module_views

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from nemo_dcr.stores.base import Store
    from nemo_dcr.sync.follower import SyncResult

log = logging.getLogger("nemo_dcr.callbacks")

NameMap = Mapping | Callable[[str], str | None] | None


class _RWLock:
    """Many samplers at once, or one update; a waiting update goes before new samplers."""

    def __init__(self):
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0
        self._local = threading.local()

    def reading(self) -> bool:
        return getattr(self._local, "n", 0) > 0

    @contextlib.contextmanager
    def read(self):
        if self.reading():  # nested sampling() in one thread
            self._local.n += 1
            try:
                yield
            finally:
                self._local.n -= 1
            return
        with self._cond:
            while self._writer or self._writers_waiting:
                self._cond.wait()
            self._readers += 1
        self._local.n = 1
        try:
            yield
        finally:
            self._local.n = 0
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def write(self):
        if self.reading():
            raise DcrError("update() called inside sampling() in the same thread: it would wait for itself")
        with self._cond:
            self._writers_waiting += 1
            try:
                while self._writer or self._readers:
                    self._cond.wait()
            finally:
                self._writers_waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


class _Published(MutableMapping):
    """The receiver's tensors, keyed by *published* name, for the Follower.

    Lookups map a published name to the receiver's (``name_map``); iteration (the state digest)
    yields the published names the receiver holds: those seen in a delta once one has been
    applied, before that the inverse of ``name_map`` over the receiver's names. Adding or removing
    a tensor is refused: the loader writes only into the model's own tensors."""

    def __init__(self, tensors: dict[str, torch.Tensor], name_map: NameMap):
        self.recv = tensors
        self.name_map = name_map
        self.seen: dict[str, str] = {}
        self.hidden: set = set()  # replicas another rank of the group holds for the follower

    def resolve(self, name: str) -> str | None:
        m = self.name_map
        r: str | None
        if m is None:
            r = name
        elif callable(m) and not isinstance(m, Mapping):
            r = m(name)
        else:
            r = m.get(name, name)
        return r if r is not None and r in self.recv and r not in self.hidden else None

    def _names(self):
        if self.seen:
            return list(self.seen)
        m = self.name_map
        if m is None:
            return [r for r in self.recv if r not in self.hidden]
        if isinstance(m, Mapping):
            inv = {v: k for k, v in m.items()}
            return [inv.get(r, r) for r in self.recv if self.resolve(inv.get(r, r)) == r]
        raise DcrError("with a callable name_map the published names are known only after the first version is "
                       "applied: start without version= (the first update reads a keyframe), or give a dict")

    def __getitem__(self, name):
        r = self.resolve(name)
        if r is None:
            raise KeyError(name)
        self.seen[name] = r
        return self.recv[r]

    def __contains__(self, name):
        return self.resolve(name) is not None

    def __iter__(self):
        return iter(self._names())

    def __len__(self):
        return len(self.recv) - len(self.hidden)

    def __setitem__(self, name, value):
        r = self.resolve(name)
        held = self.recv.get(r) if r is not None else None
        what = "no tensor of that name" if held is None else f"{held.dtype} {tuple(held.shape)}"
        raise DcrError(f"published tensor {name!r} ({value.dtype} {tuple(value.shape)}) does not fit the receiver "
                       f"({what}); the publisher and the rollout model differ (names: see name_map; dtypes: the "
                       "publisher's dtype= option)")

    def refuse_new(self, entries) -> None:
        """Called before the first write with every published tensor that does not fit a tensor
        the receiver holds (``delta.apply.refuse_misfits``): one error saying what differs and
        the likely cause; nothing was changed."""
        missing, other, dtypes = [], [], set()
        for e in entries:
            r = self.resolve(e.name)
            held = self.recv.get(r) if r is not None else None
            shape = tuple(e.region.global_shape) if e.region is not None else ()
            if held is None:
                missing.append(e.name)
                continue
            other.append(f"{e.name!r}: published {e.torch_dtype} {shape}, the receiver holds "
                         f"{held.dtype} {tuple(held.shape)}" + (f" as {r!r}" if r != e.name else ""))
            if held.dtype != e.torch_dtype:
                dtypes.add(str(held.dtype).removeprefix("torch."))
        why = []
        if missing:
            why.append(f"{len(missing)} published tensor(s) the receiver has no tensor for "
                       f"(e.g. {', '.join(repr(n) for n in missing[:3])}){self._name_hint(missing)}")
        if other:
            why.append(f"{len(other)} with another dtype or shape ({'; '.join(other[:3])})" +
                       (f": publish in the receiver's dtype (DeltaPublishCallback(dtype={sorted(dtypes)[0]!r}))"
                        if dtypes else ""))
        raise DcrError(f"the published version does not fit the receiver, nothing was changed: {'; '.join(why)}")

    def _name_hint(self, missing) -> str:
        """The likely cause of published names the receiver lacks: a prefix one side has and
        the other does not (a LightningModule's ``model.`` around a Hugging Face model)."""
        held = set(self.recv)
        extra: dict[str, int] = {}   # prefix the publisher added
        lacks: dict[str, int] = {}   # prefix the receiver has
        for n in missing:
            parts = n.split(".")
            for i in range(1, len(parts)):
                if ".".join(parts[i:]) in held:
                    p = ".".join(parts[:i]) + "."
                    extra[p] = extra.get(p, 0) + 1
                    break
            else:
                for r in held:
                    if r.endswith("." + n):
                        p = r[:-len(n)]
                        lacks[p] = lacks.get(p, 0) + 1
                        break
        if extra:
            p = max(extra, key=lambda k: extra[k])
            sub = p.rstrip(".")
            return (f"; {extra[p]} of them are the receiver's names with {p!r} in front: the trainer published "
                    f"the wrapper's names (a LightningModule holding the model as self.{sub}): publish the inner "
                    f"model (DeltaPublishCallback(submodule={sub!r})) or map the names "
                    f"(name_map=lambda n: n.removeprefix({p!r}))")
        if lacks:
            p = max(lacks, key=lambda k: lacks[k])
            return (f"; {lacks[p]} of them are in the receiver under {p!r}: map the names "
                    f"(name_map=lambda n: {p!r} + n)")
        return "; the publisher and the rollout model differ (see name_map)"

    def __delitem__(self, name):
        raise DcrError(f"the trainer no longer publishes {name!r}; the receiver keeps its tensor")


class _PublishedShards(Mapping):
    """The receiver's ShardSpecs (keyed by its own names), looked up by published name."""

    def __init__(self, shards: Mapping, tensors: _Published):
        self.shards, self.tensors = dict(shards or {}), tensors

    def __getitem__(self, name):
        r = self.tensors.resolve(name)
        if r is None or r not in self.shards:
            raise KeyError(name)
        return self.shards[r]

    def __iter__(self):
        if not self.shards:
            return iter([])
        try:
            names = self.tensors._names()
        except DcrError:  # a callable name_map before the first version: looked up lazily instead
            return iter([])
        return iter([n for n in names if self.tensors.resolve(n) in self.shards])

    def __len__(self):
        return len(self.shards)


class RolloutLoader:
    """Bring a rollout model's weights to the newest committed version, in place, verified.

    Args:
        store: store URL (a directory, ``file:///abs/dir``, ``s3://bucket/prefix``) or a Store.
        model_or_tensors: a ``torch.nn.Module`` (its parameters and persistent buffers, by
            ``state_dict`` name; DTensor parameters as this rank's blocks of them, placed by
            their placements) or a dict of name -> tensor to write into.
        shards: receiver name -> ``ShardSpec`` for tensors that are a shard of the published one.
        group: the rollout engine's own process group when it is sharded (every rank calls
            ``update`` together); None otherwise.
        name_map: published name -> receiver name (dict, or callable returning None for a tensor
            this receiver does not hold).
        check_every: every N updates, recompute the whole state's digest (O(model)) and rebuild
            from a keyframe if something else changed the weights (0: never).
        version: the version ``model_or_tensors`` already holds (e.g. 0 when both sides load the
            same initial checkpoint and the trainer used ``publish_initial``): checked against
            its digest, then only deltas are downloaded. None: the first update reads a keyframe.
        on_update: ``fn(version, sync_result)`` called after each update that changed the
            weights, inside the update lock (e.g. to reset an engine's prefix cache).
        staging: keep a CPU copy to apply to (see the module doc). "auto": when any tensor is
            not on the CPU. False with tensors on a device: applied there in place, only the
            changes cross (not for a sharded engine's group).
        follower_options: further :class:`~nemo_dcr.sync.follower.Follower` options, e.g.
            ``{"name": "rollout-3", "metrics_port": 9464}`` (how it reports itself to relays;
            Prometheus ``/metrics`` and ``/healthz``); an ``on_write`` hook is called with the
            receiver's names (``name_map`` applied).
    """

    def __init__(self, store: Store | str, model_or_tensors, shards: Mapping[str, ShardSpec] | None = None,
                 group: ProcessGroup | None = None,
                 name_map: NameMap = None, check_every: int = 0, *, version: int | None = None,
                 verify_initial: bool = True, on_update: Callable[[int | None, SyncResult], None] | None = None,
                 workers: int | None = None, staging: str | bool = "auto", follower_options: dict | None = None):
        from nemo_dcr.sync.follower import Follower
        from nemo_dcr.sync.group import Group

        if isinstance(model_or_tensors, torch.nn.Module):
            # DTensor parameters (FSDP2, TP): this rank's blocks, placed by their own placements
            live, own = module_views(model_or_tensors)
            shards = {**own, **dict(shards or {})}
        elif isinstance(model_or_tensors, Mapping):
            live = {k: (v.data if isinstance(v, torch.nn.Parameter) else v) for k, v in model_or_tensors.items()}
        else:
            raise TypeError(f"model_or_tensors must be a torch.nn.Module or a mapping of tensors, "
                            f"not {type(model_or_tensors).__name__}")
        if check_every < 0:
            raise ValueError("check_every must be >= 0")
        self.live = live
        self.check_every = int(check_every)
        self.on_update = on_update
        self.group = Group(group)
        self._lock = _RWLock()
        self._updates = 0
        self.last_result: SyncResult | None = None
        self._inference = any(t.is_inference() for t in live.values())
        if staging == "auto":
            staging = any(t.device.type != "cpu" for t in live.values())
        self.staging = bool(staging)
        if self.staging:
            pin = torch.cuda.is_available()
            with self._writing():
                self.recv = {k: self._cpu_copy(t, pin) for k, t in live.items()}
            self._seen_versions = {k: t._version for k, t in self.recv.items()}
        else:
            self.recv = live
        self.tensors = _Published(self.recv, name_map)
        self.shards = _PublishedShards(shards or {}, self.tensors)
        unknown = set(self.shards.shards) - set(self.recv)
        if unknown:
            raise DcrError(f"shards names tensors the receiver does not hold: {sorted(unknown)[:5]}")
        self._replicas: list = []  # (receiver name, the group ranks holding it), same on every rank
        self._replica_versions: dict = {}
        if self.group.active:
            self._plan_replicas(self.shards.shards)
        options = dict(follower_options or {})
        hook = options.get("on_write")
        if hook is not None:  # told in the receiver's own names, as every other option here speaks
            def on_write(name, glob, new, _resolve=self.tensors.resolve, _hook=hook):
                _hook(_resolve(name) or name, glob, new)
            options["on_write"] = on_write
        with self._writing():
            self.follower = Follower(store, self.tensors, self.shards, version=version, group=group,
                                     workers=workers, verify_initial=verify_initial, **options)
        self.store = self.follower.store

    # ------------------------------------------------------------------ public
    @property
    def version(self) -> int | None:
        """The verified version the weights hold (None: none yet, or mid-update after a failure)."""
        return self.follower.version

    def latest(self) -> int | None:
        """The newest committed version in the store (None: nothing published yet)."""
        return self.follower.latest()

    def sampling(self):
        """Context manager: hold it while the engine reads the weights; updates wait for it."""
        return self._lock.read()

    def update(self, version: int | None = None) -> int | None:
        """If a newer committed version (or ``version``) exists, bring the weights to it in place
        and verify them; return the version the weights hold (unchanged if nothing is newer, None
        if the store is still empty). Waits for ``sampling()`` blocks to finish. Raises on an
        error (corrupt object, wrong base, ...); the follower then knows the weights are in between
        and the next update repairs them."""
        if self._lock.reading():
            raise DcrError("update() called inside sampling() in the same thread: it would wait for itself")
        # outside the lock: usually nothing is new, and samplers need not wait to learn that
        head = self.follower.read_head()
        if head is None:
            return self.version
        if self.follower.is_current(head, version):  # the very manifest, not just its number
            return self.version
        with self._lock.write(), self._writing():
            before = self.version
            res = self.follower.sync(version, head=head)
            self._publish_to_engine()
            self._updates += 1
            if self.check_every and self._updates % self.check_every == 0:
                try:
                    self._check_locked()
                except BaseMismatchError as e:
                    log.warning("nemo-dcr: %s; rebuilding from a keyframe", e)
                    again = self.follower.sync(version, head=head)
                    again.steps = res.steps + again.steps
                    res = again
                    self._publish_to_engine()
            self.last_result = res
            if res.updated and self.on_update is not None:
                self.on_update(self.version, res)
            if res.updated:
                log.debug("nemo-dcr: version %s -> %s (%s), %d bytes, %.2f s", before, self.version, res.steps,
                          res.bytes, res.seconds)
        return self.version

    __call__ = update

    def check(self) -> None:
        """Recompute the whole state's digest now (O(model)); raises BaseMismatchError if the
        weights are not the version the loader believes (the next update then rebuilds them)."""
        with self._lock.write(), self._writing():
            self._check_locked()

    def _check_locked(self) -> None:
        if self.staging and self.version is not None:  # what the engine holds is what counts
            self._refresh_from_device()
        self.follower.check()

    def _publish_to_engine(self) -> None:
        """After the follower wrote: replicas to the other ranks, staged tensors to the device."""
        self._sync_replicas()
        if self.staging:
            self._copy_to_device()

    # ------------------------------------------------------------------ replicas
    def _plan_replicas(self, shards: Mapping) -> None:
        """In a group, a tensor (region) held whole by several ranks (a TP engine's norms, kv
        heads replicated over ranks) must be counted in the state digest once: the lowest rank
        holding it applies the deltas to it and sends it to the others holding it after each
        update. Different ranks may hold different regions of one tensor, each by a set of its
        own (2 kv heads at TP=4: ranks 0-1 hold one, 2-3 the other)."""
        def region(name, t):
            spec = shards.get(name) or ShardSpec.full(t.shape)
            return tuple(spec.global_shape), tuple(spec.offsets), tuple(spec.shape), spec.index_shape, str(t.dtype)

        mine = {name: region(name, t) for name, t in self.recv.items()}
        every = self.group.all_gather(mine)
        me = self.group.rank
        sets: dict = {}  # (name, region) -> the ranks holding it, in rank order
        for r, held in enumerate(every):
            for name, reg in held.items():
                sets.setdefault((name, reg), []).append(r)
        # every rank lists every set, in one order: the sends and receives of _sync_replicas
        # then pair up in the same order on every rank
        for (name, _), holders in sorted(sets.items(), key=lambda kv: (kv[0][0], kv[1][0])):
            if len(holders) < 2:
                continue
            self._replicas.append((name, tuple(holders)))
            if me in holders:
                if holders[0] != me:
                    self.tensors.hidden.add(name)
                self._replica_versions[name] = self._counter(self.recv[name])

    @staticmethod
    def _counter(t: torch.Tensor):
        try:
            return t._version
        except RuntimeError:  # an inference tensor keeps no version counter
            return None

    def _sync_replicas(self) -> None:
        if not self._replicas:
            return
        import torch.distributed as dist

        from nemo_dcr.state.dtypes import int_view

        me = self.group.rank
        changed = {}
        for name, holders in self._replicas:
            if holders[0] == me:
                v = self._counter(self.recv[name])
                changed[name] = v is None or v != self._replica_versions[name]
        every = self.group.all_gather(changed)

        def rank_of(r: int) -> int:
            return dist.get_global_rank(self.group.group, r) if self.group.group is not None else r

        for name, holders in self._replicas:
            owner = holders[0]
            if me not in holders or not every[owner].get(name):
                continue
            t = self.recv[name]
            bits = int_view(t)
            buf = bits if bits.is_contiguous() and bits.device.type == "cpu" else bits.detach().cpu().contiguous()
            # as bytes: gloo has no 16-bit integer type (a bf16 tensor's int16 view fails to send);
            # point to point within the set, so that the other sets' transfers are not waited on
            flat = buf.reshape(-1).view(torch.uint8)
            if owner == me:
                for r in holders[1:]:
                    dist.send(flat, dst=rank_of(r), group=self.group.group)
            else:
                dist.recv(flat, src=rank_of(owner), group=self.group.group)
            if buf is not bits:
                bits.copy_(buf)
            elif owner != me and self._counter(t) is not None:
                # a receive writes behind autograd's back: the version counter, which those that
                # watch this tensor for changes read (the vLLM worker rebuilds the layers whose plain
                # copies changed), would still say "unchanged" on the receiving ranks
                torch.autograd.graph.increment_version(t)
            if self.staging and owner != me:
                self.live[name].copy_(t)
                self._seen_versions[name] = t._version
            self._replica_versions[name] = self._counter(t)

    # ------------------------------------------------------------------ staging
    def _writing(self):
        return torch.inference_mode() if self._inference else torch.no_grad()

    @staticmethod
    def _cpu_copy(t: torch.Tensor, pin: bool) -> torch.Tensor:
        with torch.inference_mode(False):
            out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin and t.device.type == "cuda")
        out.copy_(t)
        return out

    def _copy_to_device(self) -> None:
        changed = 0
        for k, cpu in self.recv.items():
            if cpu._version != self._seen_versions[k]:
                self.live[k].copy_(cpu, non_blocking=cpu.is_pinned())
                self._seen_versions[k] = cpu._version
                changed += 1
        if changed and torch.cuda.is_available():
            torch.cuda.synchronize()

    def _refresh_from_device(self) -> None:
        for k, cpu in self.recv.items():
            cpu.copy_(self.live[k])
            self._seen_versions[k] = cpu._version


__all__ = ["RolloutLoader"]
