"""Lightning callback: publish the trainer's weights as a chain of bit-exact deltas.

    trainer = lightning.Trainer(callbacks=[DeltaPublishCallback("s3://bucket/run1", every_n_steps=1)])

The publishing itself (snapshot on the training thread, diff/encode/upload/commit in a
background thread, failures raised in the training loop, the joint publish of sharded models,
resume checks) is ``publish_loop.PublishLoop``, which the Hugging Face ``Trainer`` callback
(``hf_trainer.py``) drives too; this module maps Lightning's hooks onto it: ``on_train_start`` starts it,
``on_train_batch_end`` tells it each optimizer step, the metrics go to ``trainer.loggers`` and
the resume record into Lightning checkpoints (``state_dict`` / ``load_state_dict``). Weights on a
GPU are captured on the device (``device="auto"``, ``integrations/device_snapshot.py``): only the
changes come to the host.

Distributed runs: a plain LightningModule is replicated on every data-parallel rank, so global
rank 0 alone publishes it. A Megatron model (``integrations/megatron.py``), a module with
DTensor parameters (FSDP2, ``integrations/dtensor.py``) or a custom ``snapshot_fn`` is published
jointly by every rank, each rank its own shards; the receipts are gathered over a dedicated
gloo group made in ``on_train_start`` (so the background thread's collectives never interleave with
training's).
"""
from __future__ import annotations

import torch

from nemo_dcr.errors import DeltaPublishError
from nemo_dcr.util.extras import require

require("lightning.pytorch", "lightning", "DeltaPublishCallback")
from lightning.pytorch import Callback  # noqa: E402
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn  # noqa: E402

from .publish_loop import SKIP_MODES, LoopCallback  # noqa: E402

PROGRESS_BAR = ("dcr/version", "dcr/change_rate")  # the metrics shown in the training progress bar


class DeltaPublishCallback(LoopCallback, Callback):
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
        format_version: delta format version (5 by default: the state digests under their
            definition 2, cheaper to sum whole; 4, 3, 2 or 1 while receivers older than version
            5, 4, 3 or 2 follow the store).
        object_checksum: each part's checksum in its manifest: ``blake3`` (manifest formats 4
            and 5, the default from format version 3) or ``sha256`` (format 3: while receivers of
            the release before format 4 follow the store; with no ``format_version``, version 4).
        device: ``auto`` (default): weights on a CUDA device are diffed there at each publish
            and only the change stream (and a digest per tensor) comes to the host; ``on``: that,
            or an error where it cannot run; ``off``: a host copy of the weights per publish.
        keep: where the device path keeps the last published version: ``device`` (device
            memory: one copy of the published tensors per rank) or ``pinned`` (pinned host memory
            instead; each publish then streams it to the device for the diff, O(model) bytes
            host-to-device, still O(changes) device-to-host).
    """

    _info = staticmethod(rank_zero_info)
    _warn = staticmethod(rank_zero_warn)

    _last_seen_step: int | None = None  # trainer.global_step at the last batch end

    # ------------------------------------------------------------------ public
    @property
    def state_key(self) -> str:
        return self._generate_state_key(store=self.loop.store_name)

    def mark_skipped(self) -> None:
        """Tell the callback that this batch's optimizer step was skipped (a mixed-precision step
        with inf/NaN gradients, a strategy that dropped the update, an ``optimizer_step`` override
        that did not step). Call it before the batch ends (``training_step``, ``optimizer_step``,
        ``on_before_optimizer_step``). Lightning counts such a step in ``global_step`` all the
        same (automatic optimization), so the callback cannot tell without this. At a
        publishing step, ``on_skipped_step`` then decides: ``skip`` publishes nothing, ``empty``
        publishes a version anyway (an empty delta: the weights did not change)."""
        self._skip_marked = True

    # ------------------------------------------------------------------ lightning hooks
    def on_train_start(self, trainer, pl_module) -> None:
        # started here, not in ``setup``: a module built in ``configure_model`` (NeMo's GPTModel, a
        # model sharded with FSDP2 there) only exists, wrapped by its strategy, from here on, and
        # whether every rank publishes its own part (a Megatron or DTensor model) depends on it
        self._last_seen_step = trainer.global_step
        target = self._target(pl_module)
        self.loop.start(target)
        self.loop.train_start(target, trainer.global_step, self._meta(trainer))
        # (a foreground publish_initial's metrics: pl_module.log may not log on a step here)
        self._log_results(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.loop.raise_if_failed()
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
        self.loop.step_end(self._target(pl_module), step, self._meta(trainer), skipped=skipped, global_step=gs)
        self._log_results(trainer, pl_module)  # (a foreground publish: this step's version)

    def on_train_end(self, trainer, pl_module) -> None:
        try:
            self.loop.flush()
        finally:
            self._log_results(trainer, final=True)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit":
            return
        self.loop.stop(wait=True)
        self.loop.raise_if_failed()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        # training failed: stop uploading (queued snapshots are dropped, the one in flight is
        # given a moment to finish); a background error not yet raised is reported here
        self.loop.abort(exception)

    def state_dict(self) -> dict:
        # a checkpoint names the version its weights were published as: wait for that commit
        return self.loop.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.loop.load_state_dict(state_dict)

    # ------------------------------------------------------------------ internals
    def _target(self, pl_module):
        return pl_module.get_submodule(self.submodule) if self.submodule else pl_module

    @staticmethod
    def _meta(trainer) -> dict:
        return {"epoch": int(trainer.current_epoch)}

    def _log_results(self, trainer, pl_module=None, final: bool = False) -> None:
        """Finished publishes' metrics, from the training thread: to the trainer's loggers at the
        step each version was published at, and, newest value per name, through
        ``pl_module.log`` (``logger=False``: the loggers have them already) into
        ``trainer.callback_metrics`` and, for ``PROGRESS_BAR``, the progress bar. Where ``log``
        may not be called (no ``pl_module``: at the start and the end of training) straight into
        ``callback_metrics``."""
        results = self.loop.take_results()
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


__all__ = ["DeltaPublishCallback", "DeltaPublishError", "SKIP_MODES"]
