"""A Transformers ``Trainer`` program resumed by rslurm (tests/test_hf.py), run under ``rslurm launch -n 2``.

A GPT-2 of 2 layers and 32 dimensions built from its config (nothing downloaded), dropout on, trained by
the Trainer with DDP over gloo on CPU: 48 sequences, 4 per rank and step, so 6 steps per epoch and 3
epochs, evaluated every ``--eval-steps`` steps when given, logging every ``--logging-steps`` (``$RSLURM_REHEARSE_STEPS`` steps when set, for ``rslurm rehearse --steps``). The only rslurm line is ``train(trainer, ...)`` in place of ``trainer.train()``.

Every micro-batch is logged as a JSON line (global step, a checksum of the batch's tokens, the loss) by a
Trainer subclass of the test's own, independent of what rslurm records; a run that reaches the last step
writes each rank's final weights and optimizer state for a bitwise comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import resilient_slurm
from resilient_slurm.integrations.hf import RslurmCallback, train


class Tokens(torch.utils.data.Dataset):
    """Fixed random token sequences (a language-modelling set built in memory)."""

    def __init__(self, n: int, length: int, vocab: int, *, augment: bool = False) -> None:
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)
        self.vocab = vocab
        self.augment = augment

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.ids[i]
        if self.augment:  # an augmentation drawn from Python's global RNG when the sample is read
            ids = (ids + random.randrange(3)) % self.vocab
        return {"input_ids": ids, "labels": ids}


def masking_collator(features: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A collator that masks a quarter of the labels at random from torch's global RNG, as a masked-LM
    collator does (run in the main process with no DataLoader worker)."""
    batch = {k: torch.stack([f[k] for f in features]) for k in features[0]}
    labels = batch["labels"].clone()
    labels[torch.rand(labels.shape) < 0.25] = -100
    batch["labels"] = labels
    return batch


def _path(template: str, rank: int) -> str:
    """``%r``: the rank; ``%d``: the directory above ``$RSLURM_LOCAL_DIR`` (each run of ``rslurm rehearse``
    has its own), so that a rehearsal's runs keep their logs apart."""
    run_dir = os.path.dirname(os.environ.get("RSLURM_LOCAL_DIR", "").rstrip("/")) or "."
    return template.replace("%r", str(rank)).replace("%d", run_dir)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--log", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--every-steps", type=int, default=None)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--work", default=".")
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--eval-steps", type=int, default=0, help="evaluate every N steps (its loader draws from the RNG)")
    ap.add_argument("--logging-steps", type=int, default=1)
    ap.add_argument("--random-data", action="store_true",
                    help="draw from the global RNGs while reading a batch: the dataset (Python's random) and the "
                         "collator (torch) in the main process")
    args = ap.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    log = open(_path(args.log, rank), "a")
    sleep = args.step_sleep

    class LoggingTrainer(Trainer):
        def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
            loss = super().training_step(model, inputs, num_items_in_batch)
            log.write(json.dumps({"step": self.state.global_step + 1, "loss": loss.item(),
                                  "batch": int(inputs["input_ids"].sum()),
                                  "masked": int((inputs["labels"] == -100).sum())}) + "\n")
            log.flush()
            if sleep:
                time.sleep(sleep)  # only when the step ends, never what it computes
            return loss

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.2, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    rehearse = int(os.environ.get("RSLURM_REHEARSE_STEPS") or 0)  # rslurm rehearse --steps: fewer steps
    targs = TrainingArguments(output_dir=os.path.join(args.work, "hf-out"), max_steps=rehearse or -1,
                              use_cpu=True, ddp_backend="gloo",
                              ddp_find_unused_parameters=False,
                              per_device_train_batch_size=4, gradient_accumulation_steps=args.grad_accum, num_train_epochs=args.epochs, learning_rate=1e-3,
                              warmup_steps=3, lr_scheduler_type="linear", save_strategy="no", report_to=[],
                              logging_steps=args.logging_steps, seed=7, dataloader_num_workers=args.workers, disable_tqdm=True,
                              eval_strategy="steps" if args.eval_steps else "no", eval_steps=args.eval_steps or None,
                              per_device_eval_batch_size=4)
    trainer = LoggingTrainer(model=model, args=targs, train_dataset=Tokens(48, 16, 64, augment=args.random_data),
                             eval_dataset=Tokens(8, 16, 64) if args.eval_steps else None,
                             data_collator=masking_collator if args.random_data else None)
    log.write(json.dumps({"event": "start", "pid": os.getpid(), "rslurm": resilient_slurm.__file__,
                          "world": targs.world_size}) + "\n")
    log.flush()
    train(trainer, every_steps=args.every_steps)  # instead of trainer.train()
    done = trainer.state.global_step >= trainer.state.max_steps
    if done:
        torch.save({"model": model.state_dict(), "optimizer": trainer.optimizer.state_dict()},
                   _path(args.out, rank))
    [cb] = [c for c in trainer.callback_handler.callbacks if isinstance(c, RslurmCallback)]
    # The Trainer's log history of a run that reached the end (its losses, learning rates, gradient norms and
    # evaluations, and the final entry's FLOP count; not its timings, nor its train_loss, the mean over this
    # train() call's steps): a resumed run's must be the uninterrupted run's.
    keys = ("step", "epoch", "loss", "grad_norm", "learning_rate", "eval_loss", "total_flos")
    history = [{k: e[k] for k in keys if k in e} for e in trainer.state.log_history
               if "loss" in e or "eval_loss" in e or "total_flos" in e]
    log.write(json.dumps({"event": "exit", "step": trainer.state.global_step, "done": done,
                          "restored": cb.restored_step, "stopped": cb.should_stop,
                          "history": history if done else None}) + "\n")
    log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
