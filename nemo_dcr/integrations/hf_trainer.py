"""Hugging Face ``Trainer`` callback (and so TRL's trainers, which are ``Trainer``s): publish the
weights as a chain of bit-exact deltas after every ``every_n_steps`` optimizer steps.

    from nemo_dcr.integrations import DeltaPublishTrainerCallback
    trainer = transformers.Trainer(model, args, train_dataset=ds,
                                   callbacks=[DeltaPublishTrainerCallback("s3://bucket/run1")])

The publishing is ``publish_loop.PublishLoop``, the same code the Lightning callback drives;
this module maps the ``TrainerCallback`` events onto it:

* ``on_train_begin``: start (the dedicated gloo group in a distributed run, the ``Publisher``,
  the upload thread); ``publish_initial`` publishes the initial weights (not on resume).
* ``on_step_end`` (after each optimizer step, gradient accumulation included:
  ``state.global_step`` has just advanced): publish when ``global_step % every_n_steps == 0``. A
  step the optimizer skipped (accelerate's ``optimizer.step_was_skipped``: fp16 inf/NaN
  gradients), or one marked with :meth:`mark_skipped`, publishes nothing, or an empty version
  with ``on_skipped_step="empty"``. A failed background publish is raised here.
* ``on_log``: the metrics of the publishes committed since the last log (``dcr/version``,
  ``dcr/change_rate``, ``dcr/bytes``, ``dcr/ratio``, ``dcr/publish_s``, ``dcr/snapshot_s``,
  ``dcr/keyframe``, ``dcr/stall_s``) go into the trainer's logs: every publish as its own entry
  of ``state.log_history`` (with its ``step``), the newest one's values into the ``logs`` of
  this ``Trainer.log`` call for the callbacks after this one (``report_to`` integrations are
  registered before user callbacks: to have them report ``dcr/*`` too, give them after this
  one, e.g. ``report_to="none", callbacks=[dcr_cb, TensorBoardCallback()]``).
* ``on_train_end``: wait for every publish to commit; their metrics go into
  ``state.log_history``.

Resume: the callback is an ``ExportableState``: each Trainer checkpoint's ``trainer_state.json``
records the version its weights were published as (``state()`` waits for that commit), and a run
resumed from it (``trainer.train(resume_from_checkpoint=...)``) reads the record back in
``on_train_begin`` and continues the chain from that version (a keyframe if the store no longer
holds it on HEAD's chain), as the Lightning callback does.

Which model: the ``model`` the Trainer hands to its callbacks (``trainer.model``: under FSDP2
the sharded module itself, under DDP the module inside the wrapper); ``submodule`` publishes a
part of it by name. DTensor (FSDP2) and Megatron models are published jointly by every rank.
"""
from __future__ import annotations

import logging
from typing import Any

from nemo_dcr.util.extras import require

require("transformers", "hf", "DeltaPublishTrainerCallback")
from transformers import TrainerCallback  # noqa: E402
from transformers.trainer_callback import ExportableState  # noqa: E402

from .publish_loop import OPTIONS, LoopCallback  # noqa: E402

log = logging.getLogger("nemo_dcr.callbacks")

# what ``state()`` exports as constructor arguments (JSON values; a snapshot_fn is not one)
_EXPORTED = tuple(o for o in OPTIONS if o != "snapshot_fn") + ("submodule",)


class DeltaPublishTrainerCallback(LoopCallback, TrainerCallback, ExportableState):
    """Publish the model's weights to a nemo-dcr store after every ``every_n_steps`` optimizer
    steps of a ``transformers.Trainer`` (see the module doc). The arguments are those of the
    Lightning ``DeltaPublishCallback``; ``submodule`` names a part of the Trainer's model."""

    def __init__(self, *args, **kwargs):  # LoopCallback's arguments
        super().__init__(*args, **kwargs)
        self._pending: dict[int, dict] = {}  # step -> metrics not logged yet

    # ------------------------------------------------------------------ public
    def mark_skipped(self) -> None:
        """This step's optimizer update was skipped (beyond what accelerate reports itself); call
        it before the step ends. ``on_skipped_step`` decides what a publishing step then does."""
        self._skip_marked = True

    # ------------------------------------------------------------------ ExportableState
    def state(self) -> dict:
        # called as a checkpoint is saved: it names the version its weights were published as
        args = {k: getattr(self, k) for k in _EXPORTED}
        args.update(device=self.device.device, keep=self.device.capture.keep)  # (the device path's modes)
        if not isinstance(args["store"], str):
            args["store"] = self.loop.store_name
        return {"args": args, "attributes": {"resume_record": self.loop.state_dict()}}

    @property
    def resume_record(self) -> dict:
        """What a checkpoint records (``PublishLoop.state_dict``); setting it (as the Trainer's
        ``restore_callback_states_from_checkpoint`` does) resumes the chain from it."""
        return self.loop.last_published

    @resume_record.setter
    def resume_record(self, record: dict) -> None:
        self.loop.load_state_dict(record)

    # ------------------------------------------------------------------ TrainerCallback events
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        target = self._target(model)
        if state.global_step > 0 and not self.loop.resumed:  # resumed from a Trainer checkpoint
            record = self._record(state)
            if record is not None:
                self.loop.load_state_dict(record)
            else:
                log.warning("nemo-dcr: resuming at step %d from a checkpoint without a nemo-dcr record; the next "
                            "version follows the store's HEAD", state.global_step)
        self.loop.start(target)
        self._guard(lambda: self.loop.train_start(target, state.global_step, self._meta(state)))

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        skipped, self._skip_marked = self._skip_marked, False
        skipped = skipped or bool(getattr(optimizer, "step_was_skipped", False))
        target = self._target(model)
        self._guard(lambda: self.loop.step_end(target, state.global_step, self._meta(state), skipped=skipped))

    def on_log(self, args, state, control, logs=None, **kwargs):
        self._log_results(state, logs)

    def on_train_end(self, args, state, control, **kwargs):
        try:
            self._guard(self.loop.flush)
            self.loop.stop(wait=True)
            self.loop.raise_if_failed()
        finally:
            self._log_results(state, None, final=True)

    # ------------------------------------------------------------------ internals
    def _target(self, model):
        if model is None:
            raise ValueError("the Trainer passed no model to the callback")
        return model.get_submodule(self.submodule) if self.submodule else model

    @staticmethod
    def _meta(state) -> dict:
        return {"epoch": float(state.epoch or 0.0)}

    def _record(self, state) -> dict | None:
        """This callback's record in the resumed checkpoint's ``trainer_state.json``."""
        entry: Any = (getattr(state, "stateful_callbacks", None) or {}).get(type(self).__name__)
        if isinstance(entry, list):  # several callbacks of this class: the one for this store
            entry = next((e for e in entry if e.get("args", {}).get("store") == self.loop.store_name), None)
        if not isinstance(entry, dict):
            return None
        record = entry.get("attributes", {}).get("resume_record")
        return dict(record) if isinstance(record, dict) else None

    def _guard(self, fn):
        """Run ``fn``; a failure stops the upload thread before it reaches the training loop
        (the Trainer has no exception event to do it later)."""
        try:
            return fn()
        except BaseException as e:
            self.loop.abort(e)
            raise

    def _log_results(self, state, logs: dict | None, final: bool = False) -> None:
        # a publish's stall (queued on the training thread) and its outcome (the commit, in the
        # background) arrive separately: a step is logged once both are in (at the end, as is)
        for step, metrics in self.loop.take_results():
            self._pending.setdefault(step, {}).update(metrics)
        done = sorted(s for s, m in self._pending.items() if final or "dcr/version" in m)
        for step in done:
            state.log_history.append({**self._pending[step], "step": step})
        if done and logs is not None:
            logs.update(self._pending[done[-1]])
        for step in done:
            del self._pending[step]


__all__ = ["DeltaPublishTrainerCallback"]
