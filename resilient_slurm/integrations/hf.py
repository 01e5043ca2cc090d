"""Hugging Face: Transformers' ``Trainer`` and Accelerate loops on the :class:`Checkpointer`.

Transformers' Trainer owns the loop, so rslurm saves from a callback and resumes through the Trainer's own
resume. One line replaces ``trainer.train()``::

    from resilient_slurm.integrations.hf import train
    train(trainer, every_steps=100)          # instead of trainer.train()

- **Saving**: :class:`RslurmCallback` calls ``Checkpointer.step(state.global_step, ...)`` at every
  ``on_step_end``, the Trainer's step boundary (after the optimizer and scheduler stepped, before the next
  batch is fetched); at a step the Trainer logs or evaluates after (or that ends an epoch), after that
  (``on_log``, ``on_evaluate``, ``on_epoch_end``): the evaluation draws from the RNG, and the log's entry
  belongs in the saved log history. The loss summed since the last log is saved too, so the first loss
  logged after a resume averages the same steps as in a run never stopped. An emergency request (SIGTERM,
  the launcher) becomes a blocking save there, never in a signal handler, and the callback then sets
  ``control.should_training_stop``. The state saved: the model (unwrapped), the optimizer, the scaler, the
  RNG of every generator (the Checkpointer's own capture) and, as one JSON string, the ``TrainerState``
  (global step, epoch, log history, stateful callbacks), the LR scheduler's ``state_dict()`` and the loss
  since the last log.
- **Resuming**: before ``trainer.train()``, the newest committed step is restored into the model and an
  optimizer the Trainer then keeps (``Trainer.create_optimizer()``), and written out as the checkpoint
  folder the Trainer's ``resume_from_checkpoint`` reads (``trainer_state.json``, the model's weights,
  ``optimizer.pt``, ``scheduler.pt``, the RNG file of each process, written by the Trainer's own
  ``_save_rng_state``). The Trainer then does what it does for its own checkpoints: skips the epochs and
  batches already trained (``skip_first_batches``), restores the scheduler after creating it and the
  RNG at the point of the epoch it saved it from. Reusing that path keeps rslurm off the Trainer's loop:
  what rslurm relies on is the folder's file names and the RNG file's format, pinned in tests/test_hf.py.
  The folder is private to each rank (``tempfile``, or ``resume_dir``) and removed once the first resumed
  step has ended. Random draws made while a batch is read in the main process (a collator's masking)
  resume exactly too: the Trainer's loader reads one batch ahead, so each step also saves the RNG state
  from before that read (:class:`_FetchRng`).
- **DataLoader workers** of the Trainer's loader ignore the stop signals (Slurm signals every process of
  the step; a worker killed by it fails its rank before the save).

Accelerate: a loop of your own keeps its shape; :class:`AcceleratorCheckpointer` saves what
``accelerator.prepare`` and ``register_for_checkpointing`` gave the Accelerator, and iterates the loader
from the restored position (``accelerator.skip_first_batches``)::

    ckpt = AcceleratorCheckpointer(accelerator, every_steps=100)
    step = ckpt.restore()
    for batch in ckpt.batches(loader, epochs=3):       # resumes mid-epoch, across epochs
        ...; step += 1
        ckpt.step(step, metrics={"loss": loss.item()})
    ckpt.close()

Both import their framework lazily: the error for a missing one names ``pip install 'resilient_slurm[hf]'``.
The Trainer's integration is in hf_trainer.py, Accelerate's in hf_accelerate.py; this module is the
public name of both.
"""

from __future__ import annotations

from .hf_accelerate import AcceleratorCheckpointer
from .hf_trainer import RslurmCallback, train

__all__ = ["AcceleratorCheckpointer", "RslurmCallback", "train"]
