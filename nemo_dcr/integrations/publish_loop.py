"""What every trainer callback does, whatever the framework: the publishing loop.

    loop = PublishLoop("s3://bucket/run1", every_n_steps=1)
    loop.start(model)                      # once, on every rank: group, Publisher, upload thread
    loop.step_end(model, step, meta)       # after every optimizer step (publishes every N-th)
    loop.take_results()                    # [(step, {"dcr/version": ..., ...})] to log
    state = loop.state_dict()              # into the framework's checkpoint (waits for the commit)
    loop.load_state_dict(state)            # on resume: the chain continues from that version
    loop.stop(wait=True)

The Lightning callback (``publish.py``) and the Hugging Face ``Trainer`` callback
(``hf_trainer.py``) are thin adapters around this class: they map their framework's hooks onto
``start`` / ``step_end`` / ``stop``, put ``take_results`` into its logs and ``state_dict`` into
its checkpoints.

After every ``every_n_steps``-th optimizer step the loop snapshots the weights (a private CPU
copy, on the training thread: the only stall), then diffs, encodes, uploads and commits them in
a background thread (``nemo_dcr.sync.publisher.Publisher``). Weights on a GPU take the device
path instead (``device="auto"``, ``device_snapshot.CallbackDevice``): the snapshot is a diff on
the device against the last published version kept there (``keep``), and only the changes come
to the host. At most ``max_pending`` snapshots
wait for upload; the training loop blocks when that many are queued. A failed publish is raised
in the training loop at the next step (and at the end of training); nothing half-published is
ever visible to receivers (the store's joint commit).

Distributed runs: a plain module is replicated on every data-parallel rank, so global rank 0
alone publishes it. A Megatron model, a module with DTensor parameters (FSDP2) or a custom
``snapshot_fn`` is published jointly by every rank, each rank its own shards
(``snapshot.is_sharded``); the receipts are gathered over a dedicated gloo group made in
``start`` (so the background thread's collectives never interleave with training's).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from nemo_dcr.codec.names import CHOICES, DEFAULT_LEVEL
from nemo_dcr.delta import DEFAULT_CHUNK
from nemo_dcr.errors import DcrError, DeltaPublishError

from .device_snapshot import CallbackDevice
from .snapshot import is_sharded, parse_dtype, take_snapshot

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from nemo_dcr.sync.publisher import Publisher

log = logging.getLogger("nemo_dcr.callbacks")

SKIP_MODES = ("skip", "empty")

#: ``fn(message)``: how the loop reports (the framework's rank-zero info / warning)
Report = Callable[[str], None]


def _rank0() -> bool:
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _info(msg: str) -> None:
    if _rank0():
        log.info(msg)


def _warn(msg: str) -> None:
    if _rank0():
        log.warning(msg)


@dataclass
class _Job:
    step: int
    tensors: Mapping | None  # None: an empty version (the last published state again); a Captured job
    # on the device path
    shards: dict | None
    keyframe: bool = False
    meta: dict = field(default_factory=dict)
    snapshot_s: float = 0.0


_STOP = object()

#: the loop's options, which the callbacks built on it expose as attributes of their own
OPTIONS = ("store", "every_n_steps", "keyframe_every", "encoding", "level", "retain", "on_skipped_step", "background",
           "max_pending", "snapshot_fn", "dtype", "publish_initial", "chunk_elems", "workers", "slow_publish_s",
           "format_version", "object_checksum")


class LoopCallback:
    """Base of the callbacks that hold a :class:`PublishLoop` as ``self.loop``: each of its
    :data:`OPTIONS` as an attribute of the callback (what the callback was made with, as
    Lightning's CLI and ``TrainerCallback.state`` read them back; read from and written to the
    loop), and what a user reads of the loop."""

    def __init__(self, store: str, every_n_steps: int = 1, keyframe_every: int = 0, encoding: str = "auto",
                 level: int = DEFAULT_LEVEL, retain: int | None = None, on_skipped_step: str = "skip",
                 background: bool = True, max_pending: int = 2, snapshot_fn: Callable | None = None,
                 dtype: str | None = None, submodule: str | None = None, publish_initial: bool = False,
                 chunk_elems: int = DEFAULT_CHUNK, workers: int | None = None, slow_publish_s: float = 5.0,
                 format_version: int | None = None, object_checksum: str | None = None, device: str = "auto",
                 keep: str = "device"):
        self.loop = PublishLoop(store, every_n_steps=every_n_steps, keyframe_every=keyframe_every,
                                encoding=encoding, level=level, retain=retain, on_skipped_step=on_skipped_step,
                                background=background, max_pending=max_pending, snapshot_fn=snapshot_fn,
                                dtype=dtype, publish_initial=publish_initial, chunk_elems=chunk_elems,
                                workers=workers, slow_publish_s=slow_publish_s, format_version=format_version,
                                object_checksum=object_checksum, device=device, keep=keep, info=self._info,
                                warn=self._warn)
        self.submodule = submodule  # publish this part of the framework's model (by name)
        self._skip_marked = False   # mark_skipped() was called for the step in progress

    # how the loop reports (a framework's callback puts its own rank-zero messages here)
    _info: Report = staticmethod(_info)
    _warn: Report = staticmethod(_warn)

    @property
    def publisher(self):
        """This rank's ``Publisher`` (None before training starts and on ranks that do not publish)."""
        return self.loop.publisher

    @property
    def last_published(self) -> dict:
        """{"version", "step", "manifest"} of the last committed version (this run or the
        checkpoint it resumed from)."""
        return self.loop.last_published

    @property
    def device(self) -> CallbackDevice:
        """The device path (``device_snapshot.CallbackDevice``): its ``device`` mode, its capture
        (``capture.keep``) and whether it runs (``active``, decided at the first publish)."""
        return self.loop.device

    def flush(self) -> None:
        """Wait until every queued publish is committed; raise if one failed."""
        self.loop.flush()


def _option(name):
    return property(lambda self: getattr(self.loop, name), lambda self, v: setattr(self.loop, name, v),
                    doc=f"the publishing loop's ``{name}``")


for _name in OPTIONS:
    setattr(LoopCallback, _name, _option(_name))


class PublishLoop:
    """The publishing side of a trainer callback; see the module doc. The arguments are the
    callbacks' own (``DeltaPublishCallback`` documents each); ``info`` / ``warn`` report
    slow publishes and resume decisions (default: the ``nemo_dcr.callbacks`` logger, rank 0)."""

    def __init__(self, store: str, every_n_steps: int = 1, keyframe_every: int = 0, encoding: str = "auto",
                 level: int = DEFAULT_LEVEL, retain: int | None = None, on_skipped_step: str = "skip",
                 background: bool = True, max_pending: int = 2, snapshot_fn: Callable | None = None,
                 dtype: str | None = None, publish_initial: bool = False, chunk_elems: int = DEFAULT_CHUNK,
                 workers: int | None = None, slow_publish_s: float = 5.0, format_version: int | None = None,
                 object_checksum: str | None = None, device: str = "auto", keep: str = "device",
                 info: Report = _info, warn: Report = _warn):
        if int(every_n_steps) < 1:
            raise ValueError(f"every_n_steps must be >= 1, not {every_n_steps}")
        if on_skipped_step not in SKIP_MODES:
            raise ValueError(f"on_skipped_step must be one of {SKIP_MODES}, not {on_skipped_step!r}")
        if int(max_pending) < 1:
            raise ValueError(f"max_pending must be >= 1, not {max_pending}")
        if encoding not in CHOICES:
            raise ValueError(f"encoding must be one of {CHOICES}, not {encoding!r}")
        if retain is not None and int(retain) < 0:
            raise ValueError(f"retain must be >= 0 or None, not {retain}")
        parse_dtype(dtype)  # fail at construction on a bad name
        from nemo_dcr.sync.publisher import resolve_format
        # a bad choice fails here, not at the first publish; the checksum is kept as chosen (None:
        # the publisher's default for the version)
        self.format_version, _ = resolve_format(format_version, object_checksum)
        self.object_checksum = object_checksum
        self.store = store
        self.every_n_steps = int(every_n_steps)
        self.keyframe_every = int(keyframe_every)
        self.encoding, self.level = encoding, int(level)
        self.retain = retain
        self.on_skipped_step = on_skipped_step
        self.background = bool(background)
        self.max_pending = int(max_pending)
        self.snapshot_fn = snapshot_fn
        self.dtype = dtype
        self.publish_initial = bool(publish_initial)
        self.chunk_elems = int(chunk_elems)
        self.workers = workers
        self.slow_publish_s = float(slow_publish_s)
        self.info, self.warn = info, warn
        self.device = self._new_device(device, keep)

        self.publisher: Publisher | None = None  # on ranks that publish
        self.group: ProcessGroup | None = None  # the dedicated gloo group (distributed runs)
        self.publishes = True          # False on ranks that hold nothing to publish
        self.joint = False             # every rank publishes its own part (sharded models)
        self.started = False
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._results: list = []       # (step, metrics) of finished publishes, logged from the main thread
        self._error: BaseException | None = None
        self._error_raised = False
        self._published: dict[str, Any] = {"version": None, "step": None, "manifest": None}
        self._resume: dict | None = None
        self._check_resume = False
        self._queued = 0               # publishes asked for in this run

    # what a copy or a pickle of the loop leaves out: the running parts (NeMo's Trainer deep-copies
    # its callbacks to record its configuration; a copy is a loop that has not started)
    _RUNNING = {"publisher": None, "group": None, "started": False, "_queue": None, "_thread": None,
                "_error": None, "_error_raised": False, "_queued": 0}

    def __getstate__(self) -> dict:
        state = {k: v for k, v in self.__dict__.items() if k not in self._RUNNING and k not in ("_lock", "device")}
        with self._lock:
            state["_results"] = list(self._results)
            state["_published"] = dict(self._published)
        # the device path as configured: a copy keeps no captured state (device tensors, the
        # versions it counted), as it has no publisher
        state["device"] = (self.device.device, self.device.capture.keep)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.__dict__.update(self._RUNNING)
        self._lock = threading.Lock()
        self.device = self._new_device(*state["device"])

    def _new_device(self, device: str, keep: str) -> CallbackDevice:
        return CallbackDevice(device, keep, self.chunk_elems, self.encoding, self.level, self.keyframe_every)

    # ------------------------------------------------------------------ state
    @property
    def store_name(self) -> str:
        return self.store if isinstance(self.store, str) else str(getattr(self.store, "url", self.store))

    @property
    def uploading(self) -> bool:
        """Whether the background upload thread is running."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def resumed(self) -> bool:
        """Whether :meth:`load_state_dict` gave this run a checkpoint's version to continue from."""
        return self._resume is not None

    @property
    def last_published(self) -> dict:
        """{"version", "step", "manifest"} of the last committed version (this run or the
        checkpoint it resumed from)."""
        with self._lock:
            return dict(self._published)

    def state_dict(self) -> dict:
        """What a checkpoint records: the version its weights were published as (this waits for
        that commit), the store and ``every_n_steps``."""
        if self.publishes:
            self.flush()
        with self._lock:
            out = dict(self._published)
        out.update(store=self.store_name, every_n_steps=self.every_n_steps)
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """A checkpoint's :meth:`state_dict`: the next version follows the one it records (a
        keyframe if the store no longer holds that version on HEAD's chain)."""
        self._resume = dict(state_dict)
        self._check_resume = True
        with self._lock:
            for k in ("version", "step", "manifest"):
                self._published[k] = state_dict.get(k)

    # ------------------------------------------------------------------ lifecycle
    def start(self, target) -> None:
        """Once per run, on every rank (collective in a distributed run: it makes the group)."""
        if self.started:
            return
        from nemo_dcr.sync.publisher import Publisher

        self._queued, self._error, self._error_raised = 0, None, False
        if self.device.active is not None:  # an earlier run's captures: this run's publisher starts afresh
            self.device = self._new_device(self.device.device, self.device.capture.keep)
        self.joint = is_sharded(target, self.snapshot_fn)
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # every rank makes the group, in the same order; a plain module is published by rank 0 alone
            if self.joint:
                self.group = dist.new_group(backend="gloo")
            else:
                self.group = dist.new_group(ranks=[0], backend="gloo")
                self.publishes = dist.get_rank() == 0
        if self.publishes:
            self.publisher = Publisher(self.store, keyframe_every=self.keyframe_every, encoding=self.encoding,
                                       level=self.level, chunk_elems=self.chunk_elems, workers=self.workers,
                                       retain=self.retain, group=self.group, format_version=self.format_version,
                                       object_checksum=self.object_checksum,
                                       device=self.device.base if self.device.device != "off" else "off")
            if self.background:
                self._queue = queue.Queue(maxsize=self.max_pending)
                self._thread = threading.Thread(target=self._worker, name="nemo-dcr-publish", daemon=True)
                self._thread.start()
        self.started = True

    def train_start(self, target, step: int, meta: dict | None = None) -> None:
        """At the start of training: the initial weights, with ``publish_initial`` (not on resume)."""
        if self.publish_initial and self._resume is None and self._published["version"] is None:
            self.publish(target, step, meta, initial=True)

    def step_end(self, target, step: int, meta: dict | None = None, skipped: bool = False,
                 global_step: int | None = None) -> None:
        """After the optimizer step that made ``step`` (1-based) steps: publish when
        ``step % every_n_steps == 0``; a ``skipped`` step (no update) publishes nothing, or an
        empty version with ``on_skipped_step="empty"``. ``global_step``: the step the version
        records, when the framework's counter did not count a skipped step (default ``step``)."""
        self.raise_if_failed()
        if step % self.every_n_steps != 0:
            return
        at = step if global_step is None else global_step
        if skipped:
            if self.on_skipped_step == "empty":
                self.publish(target, at, meta, empty=True, skipped_step=step)
            return
        self.publish(target, at, meta)

    def stop(self, wait: bool = True, timeout: float | None = None) -> None:
        """End the upload thread: ``wait`` for what is queued, or drop it (a failed training run;
        the publish in flight gets ``timeout`` seconds)."""
        try:
            self._shutdown(wait, timeout)
        finally:
            self.started = False

    def abort(self, exception: BaseException | None = None) -> None:
        """Training failed: stop uploading; a background error not yet raised is reported."""
        self.stop(wait=False, timeout=30.0)
        if self._error is not None and not self._error_raised and exception is not self._error:
            log.error("nemo-dcr: a background publish had failed too: %s", self._error)

    def flush(self) -> None:
        """Wait until every queued publish is committed; raise if one failed."""
        if self._queue is not None and self._thread is not None and self._thread.is_alive():
            self._queue.join()
        self.raise_if_failed()

    def raise_if_failed(self) -> None:
        err = self._error
        if err is not None and not self._error_raised:
            self._error_raised = True
            raise err

    def take_results(self) -> list[tuple[int, dict]]:
        """``[(step, metrics)]`` of the publishes finished (or queued: ``dcr/stall_s``) since the
        last call, in order: what the callback logs."""
        with self._lock:
            results, self._results = self._results, []
        return results

    # ------------------------------------------------------------------ publishing
    def publish(self, target, step: int, meta: dict | None = None, *, empty: bool = False,
                initial: bool = False, skipped_step: int | None = None) -> None:
        """Snapshot ``target`` now and publish it (queued, or at once without ``background``)."""
        if not self.started:
            self.start(target)
        if not self.publishes:
            return
        meta = {"global_step": int(step), **(meta or {})}
        if empty:  # the step was skipped, so the weights are those of the last version: an empty delta
            if skipped_step is None:
                raise TypeError("an empty version is published for a skipped step: give skipped_step")
            meta["skipped_step"] = int(skipped_step)
        if initial:
            meta["initial"] = True
        t0 = time.perf_counter()
        on_device = self.device.wants(target, self.snapshot_fn, self.format_version)
        if not on_device and self.publisher is not None and self.publisher.device is self.device.base:
            self.publisher.device = "off"  # decided before the first publish: the host path's publisher
        tensors: Mapping | None
        if empty and self._queued:  # the worker republishes the last published state
            tensors, shards = self.device.unchanged() if on_device else (None, None)
        else:  # (nothing published in this run yet: the weights are the last version's anyway)
            with torch.no_grad():
                if on_device:
                    tensors, shards = self.device.take(target, self.dtype)
                else:
                    tensors, shards, _ = take_snapshot(target, self.snapshot_fn, self.dtype)
        job = _Job(int(step), tensors, shards, meta=meta, snapshot_s=time.perf_counter() - t0)
        self._queued += 1
        if self._queue is None:
            self._run_job(job)
            with self._lock:
                self._results.append((int(step), {"dcr/stall_s": float(time.perf_counter() - t0)}))
            self.raise_if_failed()
            return
        t1 = time.perf_counter()
        while True:  # blocks while max_pending snapshots wait; wakes up to notice a failure
            self.raise_if_failed()
            try:
                self._queue.put(job, timeout=0.5)
                break
            except queue.Full:
                continue
        wait_s = time.perf_counter() - t1
        with self._lock:  # how long this publish held the training loop
            self._results.append((int(step), {"dcr/stall_s": float(job.snapshot_s + wait_s)}))
        if wait_s >= self.slow_publish_s:
            self.info(f"nemo-dcr: training waited {wait_s:.1f} s for earlier publishes to upload "
                      f"(max_pending={self.max_pending}); publishing is slower than every_n_steps steps")

    def _worker(self) -> None:
        q = self._queue
        if q is None:  # start makes the queue before it starts this thread
            raise RuntimeError("the publish worker started without a queue")
        while True:
            job = q.get()
            try:
                if job is _STOP:
                    return
                if self._error is None:  # after a failure the rest are dropped
                    self._run_job(job)
            finally:
                q.task_done()

    def _run_job(self, job: _Job) -> None:
        try:
            t0 = time.perf_counter()
            res = self._publish_version(job)
            dt = time.perf_counter() - t0
        except BaseException as e:  # noqa: BLE001 - reported to the training loop
            with self._lock:
                if self._error is None:
                    self._error = DeltaPublishError(f"nemo-dcr: publishing the weights of step {job.step} to "
                                                    f"{self.store_name} failed: {type(e).__name__}: {e}")
                    self._error.__cause__ = e
            self.device.failed()  # a capture waiting to learn the first version stops waiting
            return
        self.device.committed(job.tensors, res.version)
        m = res.manifest
        dense = m.dense_bytes
        sent = res.delta_bytes + res.keyframe_bytes
        delta = res.delta_bytes or res.keyframe_bytes
        metrics = {
            "dcr/version": float(res.version),
            "dcr/change_rate": float(res.change_rate),
            "dcr/bytes": float(sent),
            "dcr/ratio": float(dense / delta) if delta else 0.0,
            "dcr/publish_s": float(dt),
            "dcr/snapshot_s": float(job.snapshot_s),
            "dcr/keyframe": 1.0 if m.is_keyframe else 0.0,
        }
        with self._lock:
            self._published = {"version": res.version, "step": job.step, "manifest": m.key}
            self._results.append((job.step, metrics))
        msg = (f"nemo-dcr: published version {res.version} (step {job.step}): {res.change_rate:.3%} changed, "
               f"{sent:,} bytes, {metrics['dcr/ratio']:.1f}x smaller than dense, {dt:.2f} s")
        if dt >= self.slow_publish_s:
            self.info(msg)
        else:
            log.debug(msg)

    def _publish_version(self, job: _Job):
        from nemo_dcr.errors import PublishError

        pub = self.publisher
        if pub is None:  # publish returns early on ranks without a publisher: no job is made there
            raise DcrError("a publish job on a rank that does not publish")
        keyframe = job.keyframe
        if job.tensors is None:  # an empty version: the last published state again
            if pub.published is None:
                raise DcrError("an empty version was asked for before anything was published")
            job.tensors, job.shards = pub.published
        if self._check_resume:
            self._check_resume = False
            keyframe = self._resume_needs_keyframe() or keyframe
        try:
            return pub.publish(job.tensors, job.shards, keyframe=keyframe, step=job.step, meta=job.meta)
        except PublishError as e:
            if keyframe or pub.version is not None or not self._store_has_head():
                raise
            # a fresh publisher could not rebuild the last published state from the store
            self.warn(f"nemo-dcr: could not rebuild the last published version from {self.store_name} ({e}); "
                      "publishing a keyframe instead")
            return pub.publish(job.tensors, job.shards, keyframe=True, step=job.step, meta=job.meta)

    def _store_has_head(self) -> bool:
        from nemo_dcr.sync.group import Group
        from nemo_dcr.sync.versions import read_head

        pub = self.publisher
        if pub is None:  # called from _publish_version, which checked it
            raise DcrError("no publisher on this rank")
        g = Group(self.group)  # rank 0 reads; a failure there is raised on every rank
        return bool(g.run(lambda: read_head(pub.store)[0] is not None if g.rank == 0 else None,
                          f"read HEAD of {self.store_name}", src=0))

    def _resume_needs_keyframe(self) -> bool:
        """Does the store still hold the version the checkpoint recorded, on HEAD's chain? If not
        (a wiped or foreign store, or one rolled back), the next version is also a keyframe."""
        from nemo_dcr.sync.group import Group

        g = Group(self.group)
        return bool(g.run(lambda: self._check_chain() if g.rank == 0 else None,
                          "check the checkpoint's version against the store", src=0))

    def _check_chain(self) -> bool:
        from nemo_dcr.sync.versions import read_head, walk

        r = self._resume or {}
        v, key = r.get("version"), r.get("manifest")
        if v is None:
            return False
        if self.publisher is None:  # called from _publish_version, which checked it
            raise DcrError("no publisher on this rank")
        store = self.publisher.store
        try:
            head, _ = read_head(store)
            if head is None:
                self.warn(f"nemo-dcr: the checkpoint was published as version {v} but {self.store_name} has no "
                          "versions; a new chain starts with a keyframe")
                return False  # the first version is a keyframe anyway
            if head.version < v:
                self.warn(f"nemo-dcr: {self.store_name} is at version {head.version}, behind the checkpoint's "
                          f"version {v}; the next version is a keyframe")
                return True
            m = next((m for m in walk(store, head) if m.version <= v), None)
            if m is None or m.version != v or (key is not None and m.key != key):
                self.warn(f"nemo-dcr: version {v} in {self.store_name} is not the one this checkpoint published "
                          f"({key}); the next version is a keyframe")
                return True
            if head.version > v:
                self.warn(f"nemo-dcr: {self.store_name} has versions {v + 1}..{head.version} published "
                          f"after this checkpoint; the next version follows {head.version} "
                          "(its delta undoes them)")
        except Exception as e:  # noqa: BLE001 - cannot verify: be safe
            self.warn(f"nemo-dcr: cannot verify the version chain in {self.store_name} "
                      f"({type(e).__name__}: {e}); the next version is a keyframe")
            return True
        return False

    def _shutdown(self, wait: bool, timeout: float | None = None) -> None:
        t, q = self._thread, self._queue
        if t is None or q is None:
            return
        if not wait:  # drop what is queued
            try:
                while True:
                    q.get_nowait()
                    q.task_done()
            except queue.Empty:
                pass
        if t.is_alive():
            while True:
                try:
                    q.put(_STOP, timeout=0.5)
                    break
                except queue.Full:
                    if not t.is_alive():
                        break
            t.join(timeout)
        self._thread = self._queue = None


__all__ = ["PublishLoop", "LoopCallback", "SKIP_MODES", "OPTIONS"]
