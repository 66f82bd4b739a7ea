"""Lightning callback: publish the trainer's weights as a chain of bit-exact deltas.

    trainer = lightning.Trainer(callbacks=[DeltaPublishCallback("s3://bucket/run1", every_n_steps=1)])

After every ``every_n_steps``-th optimizer step the callback snapshots the weights (a private
CPU copy, on the training thread: the only stall), then diffs, encodes, uploads and commits them
in a background thread (``nemo_dcr.publisher.Publisher``). Weights on a GPU take the device path
instead (``device="auto"``, ``integrations/device_snapshot.py``): the snapshot is a diff on the
device against the last published version kept there (``keep``), and only the changes come to
the host. At most ``max_pending`` snapshots wait
for upload; the training loop blocks when that many are queued. A failed publish is raised in
the training loop at the next step (and at the end of training); nothing half-published is ever
visible to receivers (the store's joint commit).

Distributed runs: a plain LightningModule is replicated on every data-parallel rank, so global
rank 0 alone publishes it. A Megatron model (``integrations/megatron.py``) or a custom
``snapshot_fn`` is published jointly by every rank, each rank its own shards; the receipts are
gathered over a dedicated gloo group made in ``setup`` (so the background thread's collectives
never interleave with training's).
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

from nemo_dcr.util.extras import require

require("lightning.pytorch", "lightning", "DeltaPublishCallback")
from lightning.pytorch import Callback  # noqa: E402
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn  # noqa: E402

from nemo_dcr.codec import versions as format_versions  # noqa: E402
from nemo_dcr.codec.names import CHOICES, DEFAULT_LEVEL  # noqa: E402
from nemo_dcr.codec.versions import FORMAT_VERSION  # noqa: E402
from nemo_dcr.delta import DEFAULT_CHUNK  # noqa: E402
from nemo_dcr.errors import DcrError, DeltaPublishError  # noqa: E402

from .device_snapshot import CallbackDevice  # noqa: E402
from .snapshot import is_megatron, parse_dtype, take_snapshot  # noqa: E402

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from nemo_dcr.sync.publisher import Publisher

log = logging.getLogger("nemo_dcr.callbacks")

SKIP_MODES = ("skip", "empty")
PROGRESS_BAR = ("dcr/version", "dcr/change_rate")  # the metrics shown in the training progress bar


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


class DeltaPublishCallback(Callback):
    """Publish the model's weights to a nemo-dcr store after every ``every_n_steps`` optimizer steps.

    Args:
        store: store URL: a directory, ``file:///abs/dir`` or ``s3://bucket/prefix``.
        every_n_steps: publish when ``trainer.global_step % every_n_steps == 0`` (each delta then
            carries the changes of ``every_n_steps`` steps).
        keyframe_every: also store the full state every K versions (0: only the first version).
        encoding: ``auto`` (default: per chunk ``classes`` where it pays, else the smallest of all),
            ``portable`` (the smallest of ``xor``, ``add`` and ``overwrite``: for a lone receiver
            holding only part of a trainer rank's shard), ``classes``, ``xor``, ``add`` or ``overwrite``.
        level: zstd level of the byte-plane streams, 1..22 (default ``DEFAULT_LEVEL``, 1: faster
            than 3 and as small on BF16; ``classes`` chunks use no zstd).
        retain: after each commit delete versions older than both the newest keyframe and the
            newest ``retain`` versions (None: keep everything).
        on_skipped_step: what a skipped optimizer step (see :meth:`mark_skipped`) does at a
            publishing step: ``skip`` publishes nothing, ``empty`` publishes a version with the
            same weights as the previous one (one version per publishing step, always).
        background: encode and upload in a background thread (False: in the training loop).
        max_pending: snapshots that may wait for upload before the training loop blocks.
        snapshot_fn: ``fn(module) -> (tensors, shards)`` (see ``snapshot.SnapshotFn``) instead of
            the built-in snapshots; every rank's result is published jointly, so each element
            must come from exactly one rank (a replicated tensor from one rank only, ``{}``
            from ranks that own nothing).
        dtype: publish floating-point tensors in this dtype (e.g. ``bfloat16``: what the rollout
            engine holds), whatever the trainer keeps.
        submodule: publish ``pl_module.get_submodule(submodule)`` (e.g. ``model`` for a
            LightningModule wrapping a Hugging Face model as ``self.model``), so the names are
            the inner model's own.
        publish_initial: publish the weights at the start of training (not on resume), so
            receivers loading the same initial checkpoint can start at version 0 without a download.
        chunk_elems: elements per delta chunk.
        workers: threads for encoding (None: the library's default).
        slow_publish_s: publishes taking longer than this are reported at INFO level.
        format_version: delta format version (3 by default; 2 or 1 while receivers older than
            version 3 or 2 follow the store).
        device: ``auto`` (default): weights on a CUDA device are diffed there at each publish
            and only the change stream (and a digest per tensor) comes to the host; ``on``: that,
            or an error where it cannot run; ``off``: a host copy of the weights per publish.
        keep: where the device path keeps the last published version: ``device`` (device
            memory: one copy of the published tensors per rank) or ``pinned`` (pinned host memory
            instead; each publish then streams it to the device for the diff, O(model) bytes
            host-to-device, still O(changes) device-to-host).
    """

    def __init__(self, store: str, every_n_steps: int = 1, keyframe_every: int = 0, encoding: str = "auto",
                 level: int = DEFAULT_LEVEL, retain: int | None = None, on_skipped_step: str = "skip",
                 background: bool = True, max_pending: int = 2, snapshot_fn: Callable | None = None,
                 dtype: str | None = None, submodule: str | None = None, publish_initial: bool = False,
                 chunk_elems: int = DEFAULT_CHUNK, workers: int | None = None, slow_publish_s: float = 5.0,
                 format_version: int = FORMAT_VERSION, device: str = "auto", keep: str = "device"):
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
        self.format_version = format_versions.version(format_version).number
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
        self.submodule = submodule
        self.publish_initial = bool(publish_initial)
        self.chunk_elems = int(chunk_elems)
        self.workers = workers
        self.slow_publish_s = float(slow_publish_s)
        self.device = CallbackDevice(device, keep, self.chunk_elems, encoding, self.level, self.keyframe_every)

        self.publisher: Publisher | None = None  # on ranks that publish
        self._group: ProcessGroup | None = None  # the dedicated gloo group (distributed runs)
        self._publishes = True         # False on ranks that hold nothing to publish
        self._joint = False
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._results: list = []       # (step, metrics) of finished publishes, logged from the main thread
        self._error: BaseException | None = None
        self._error_raised = False
        self._last_seen_step: int | None = None
        self._skip_marked = False
        self._published: dict[str, Any] = {"version": None, "step": None, "manifest": None}
        self._resume: dict | None = None
        self._check_resume = False
        self._setup_done = False
        self._queued = 0               # publishes asked for in this run

    # ------------------------------------------------------------------ public
    @property
    def state_key(self) -> str:
        return self._generate_state_key(store=self._store_name)

    @property
    def _store_name(self) -> str:
        return self.store if isinstance(self.store, str) else str(getattr(self.store, "url", self.store))

    @property
    def last_published(self) -> dict:
        """{"version", "step", "manifest"} of the last committed version (this run or the
        checkpoint it resumed from)."""
        with self._lock:
            return dict(self._published)

    def mark_skipped(self) -> None:
        """Tell the callback that this batch's optimizer step was skipped (a mixed-precision step
        with inf/NaN gradients, a strategy that dropped the update, an ``optimizer_step`` override
        that did not step). Call it before the batch ends (``training_step``, ``optimizer_step``,
        ``on_before_optimizer_step``). Lightning counts such a step in ``global_step`` all the
        same (automatic optimization), so the callback cannot tell without this. At a
        publishing step, ``on_skipped_step`` then decides: ``skip`` publishes nothing, ``empty``
        publishes a version anyway (an empty delta: the weights did not change)."""
        self._skip_marked = True

    def flush(self) -> None:
        """Wait until every queued publish is committed; raise if one failed."""
        if self._queue is not None and self._thread is not None and self._thread.is_alive():
            self._queue.join()
        self._raise_if_failed()

    # ------------------------------------------------------------------ lightning hooks
    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit" or self._setup_done:
            return
        from nemo_dcr.sync.publisher import Publisher

        self._queued, self._error, self._error_raised = 0, None, False
        target = self._target(pl_module)
        self._joint = self.snapshot_fn is not None or is_megatron(target)
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # every rank makes the group, in the same order; a plain module is published by rank 0 alone
            if self._joint:
                self._group = dist.new_group(backend="gloo")
            else:
                self._group = dist.new_group(ranks=[0], backend="gloo")
                self._publishes = dist.get_rank() == 0
        if self._publishes:
            self.publisher = Publisher(self.store, keyframe_every=self.keyframe_every, encoding=self.encoding,
                                       level=self.level, chunk_elems=self.chunk_elems, workers=self.workers,
                                       retain=self.retain, group=self._group, format_version=self.format_version,
                                       device=self.device.base if self.device.device != "off" else "off")
            if self.background:
                self._queue = queue.Queue(maxsize=self.max_pending)
                self._thread = threading.Thread(target=self._worker, name="nemo-dcr-publish", daemon=True)
                self._thread.start()
        self._setup_done = True

    def on_train_start(self, trainer, pl_module) -> None:
        self._last_seen_step = trainer.global_step
        if self.publish_initial and self._resume is None and self._published["version"] is None:
            self._publish(trainer, pl_module, trainer.global_step, initial=True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._raise_if_failed()
        self._log_results(trainer, pl_module)
        gs = trainer.global_step
        advanced = self._last_seen_step is None or gs != self._last_seen_step
        skipped, self._skip_marked = self._skip_marked, False
        if not advanced:
            # no optimizer step on this batch (gradient accumulation), unless one was due and
            # skipped (manual optimization that did not step, and said so)
            if not skipped:
                return
            step = gs + 1
        else:
            step = gs
        self._last_seen_step = gs
        if step % self.every_n_steps != 0:
            return
        if skipped:
            if self.on_skipped_step == "empty":
                self._publish(trainer, pl_module, gs, empty=True, skipped_step=step)
            return
        self._publish(trainer, pl_module, gs)

    def on_train_end(self, trainer, pl_module) -> None:
        try:
            self.flush()
        finally:
            self._log_results(trainer, final=True)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit":
            return
        try:
            self._shutdown(wait=True)
            self._raise_if_failed()
        finally:
            self._setup_done = False

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        # training failed: stop uploading (queued snapshots are dropped, the one in flight is
        # given a moment to finish); a background error not yet raised is reported here
        self._shutdown(wait=False, timeout=30.0)
        if self._error is not None and not self._error_raised and exception is not self._error:
            log.error("nemo-dcr: a background publish had failed too: %s", self._error)
        self._setup_done = False

    def state_dict(self) -> dict:
        # a checkpoint names the version its weights were published as: wait for that commit
        if self._publishes:
            self.flush()
        with self._lock:
            out = dict(self._published)
        out.update(store=self._store_name, every_n_steps=self.every_n_steps)
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        self._resume = dict(state_dict)
        self._check_resume = True
        with self._lock:
            for k in ("version", "step", "manifest"):
                self._published[k] = state_dict.get(k)

    # ------------------------------------------------------------------ internals
    def _target(self, pl_module):
        return pl_module.get_submodule(self.submodule) if self.submodule else pl_module

    def _publish(self, trainer, pl_module, step: int, *, empty: bool = False, initial: bool = False,
                 skipped_step: int | None = None) -> None:
        if not self._setup_done:
            self.setup(trainer, pl_module, "fit")
        if not self._publishes:
            return
        meta: dict[str, Any] = {"global_step": int(step), "epoch": int(trainer.current_epoch)}
        if empty:  # the step was skipped, so the weights are those of the last version: an empty delta
            if skipped_step is None:
                raise TypeError("an empty version is published for a skipped step: give skipped_step")
            meta["skipped_step"] = int(skipped_step)
        if initial:
            meta["initial"] = True
        t0 = time.perf_counter()
        target = self._target(pl_module)
        on_device = self.device.wants(target, self.snapshot_fn, self.format_version)
        if not on_device and self.publisher is not None and self.publisher.device is self.device.base:
            self.publisher.device = "off"  # decided before the first publish: the host path's publisher
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
            self._raise_if_failed()
            # (on_train_start, for publish_initial, may not call pl_module.log on a step)
            self._log_results(trainer, None if initial else pl_module)
            return
        t1 = time.perf_counter()
        while True:  # blocks while max_pending snapshots wait; wakes up to notice a failure
            self._raise_if_failed()
            try:
                self._queue.put(job, timeout=0.5)
                break
            except queue.Full:
                continue
        wait_s = time.perf_counter() - t1
        with self._lock:  # how long this publish held the training loop
            self._results.append((int(step), {"dcr/stall_s": float(job.snapshot_s + wait_s)}))
        if wait_s >= self.slow_publish_s:
            rank_zero_info(f"nemo-dcr: training waited {wait_s:.1f} s for earlier publishes to upload "
                           f"(max_pending={self.max_pending}); publishing is slower than every_n_steps steps")

    def _worker(self) -> None:
        q = self._queue
        if q is None:  # setup makes the queue before it starts this thread
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
                                                    f"{self._store_name} failed: {type(e).__name__}: {e}")
                    self._error.__cause__ = e
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
            rank_zero_info(msg)
        else:
            log.debug(msg)

    def _publish_version(self, job: _Job):
        from nemo_dcr.errors import PublishError

        pub = self.publisher
        if pub is None:  # _publish returns early on ranks without a publisher: no job is made there
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
            rank_zero_warn(f"nemo-dcr: could not rebuild the last published version from {self._store_name} ({e}); "
                           "publishing a keyframe instead")
            return pub.publish(job.tensors, job.shards, keyframe=True, step=job.step, meta=job.meta)

    def _store_has_head(self) -> bool:
        from nemo_dcr.sync.group import Group
        from nemo_dcr.sync.versions import read_head

        pub = self.publisher
        if pub is None:  # called from _publish_version, which checked it
            raise DcrError("no publisher on this rank")
        g = Group(self._group)  # rank 0 reads; a failure there is raised on every rank
        return bool(g.run(lambda: read_head(pub.store)[0] is not None if g.rank == 0 else None,
                          f"read HEAD of {self._store_name}", src=0))

    def _resume_needs_keyframe(self) -> bool:
        """Does the store still hold the version the checkpoint recorded, on HEAD's chain? If not
        (a wiped or foreign store, or one rolled back), the next version is also a keyframe."""
        from nemo_dcr.sync.group import Group

        g = Group(self._group)
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
                rank_zero_warn(f"nemo-dcr: the checkpoint was published as version {v} but {self._store_name} has no "
                               "versions; a new chain starts with a keyframe")
                return False  # the first version is a keyframe anyway
            if head.version < v:
                rank_zero_warn(f"nemo-dcr: {self._store_name} is at version {head.version}, behind the checkpoint's "
                               f"version {v}; the next version is a keyframe")
                return True
            m = next((m for m in walk(store, head) if m.version <= v), None)
            if m is None or m.version != v or (key is not None and m.key != key):
                rank_zero_warn(f"nemo-dcr: version {v} in {self._store_name} is not the one this checkpoint published "
                               f"({key}); the next version is a keyframe")
                return True
            if head.version > v:
                rank_zero_warn(f"nemo-dcr: {self._store_name} has versions {v + 1}..{head.version} published "
                               f"after this checkpoint; the next version follows {head.version} "
                               "(its delta undoes them)")
        except Exception as e:  # noqa: BLE001 - cannot verify: be safe
            rank_zero_warn(f"nemo-dcr: cannot verify the version chain in {self._store_name} "
                           f"({type(e).__name__}: {e}); the next version is a keyframe")
            return True
        return False

    def _raise_if_failed(self) -> None:
        err = self._error
        if err is not None and not self._error_raised:
            self._error_raised = True
            raise err

    def _log_results(self, trainer, pl_module=None, final: bool = False) -> None:
        """Finished publishes' metrics, from the training thread: to the trainer's loggers at the
        step each version was published at, and, newest value per name, through
        ``pl_module.log`` (``logger=False``: the loggers have them already) into
        ``trainer.callback_metrics`` and, for ``PROGRESS_BAR``, the progress bar. At the end of
        training (where ``log`` may not be called) straight into ``callback_metrics``."""
        with self._lock:
            results, self._results = self._results, []
        if not results:
            return
        loggers = getattr(trainer, "loggers", None) or []
        for step, metrics in results:
            for lg in loggers:
                lg.log_metrics(metrics, step=step)
        newest = {k: v for _, metrics in results for k, v in metrics.items()}
        if pl_module is not None and not final:
            for k, v in newest.items():
                pl_module.log(k, float(v), on_step=True, on_epoch=False, prog_bar=k in PROGRESS_BAR, logger=False,
                              batch_size=1)
        else:
            cm = getattr(trainer, "callback_metrics", None)
            if isinstance(cm, dict):
                cm.update({k: torch.tensor(float(v)) for k, v in newest.items()})
        if final:
            for lg in loggers:
                try:
                    lg.save()
                except Exception:  # noqa: BLE001
                    pass

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


__all__ = ["DeltaPublishCallback", "DeltaPublishError"]
