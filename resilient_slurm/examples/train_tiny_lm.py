"""A real small model for the README demo: a character-level, decoder-only transformer language model.

What it trains on: a corpus of simple English sentences generated from a small grammar with a fixed
seed (:func:`corpus`; the same text on every machine and every run, about 48 KB), or any text file
given with ``--text``. What it exercises: token and position embeddings, causal self-attention with
dropout (so every rank's RNG stream matters), AdamW with weight decay on the matrices only, linear
warmup then cosine decay of the learning rate, gradient clipping, a shuffled
:class:`~resilient_slurm.ResumableSampler` over a ``DataLoader`` with worker processes, DDP over gloo
when started with several ranks, and a :class:`~resilient_slurm.Checkpointer` saving every
``--every-steps`` steps (and at once when the launcher asks for an emergency save).

Call order: ``rslurm launch`` (or srun, or torchrun) starts the ranks; each calls ``init_distributed``,
builds the same model from the same seed, restores the newest committed step (0 when none), trains to
``--steps`` (or until an emergency checkpoint has committed) and appends one JSON line per step to
``--log`` (``step``, ``loss``, ``lr``, ``epoch``, the sample ids of its batch). A run that reaches the
last step writes its final weights, AdamW state, scheduler state and RNG to ``--out``, so a run that
was interrupted and resumed can be compared bit for bit with one that never stopped::

    rslurm launch -n 2 -- python -m resilient_slurm.examples.train_tiny_lm --steps 200 \\
        --log run.%r.jsonl --out final.%r.pt
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from resilient_slurm import Checkpointer, ResumableSampler, init_distributed

CORPUS_SEED = 20240611

_SUBJECTS = ["the cat", "a dog", "the old man", "my sister", "the captain", "a small bird", "the teacher",
             "our neighbour", "the fox", "a young girl", "the baker", "his brother"]
_TRANSITIVE = ["sees", "finds", "watches", "follows", "likes", "helps", "calls", "paints", "carries", "hears"]
_INTRANSITIVE = ["sleeps", "sings", "waits", "runs", "laughs", "works", "dances", "rests"]
_OBJECTS = ["the boat", "a red ball", "the moon", "an apple", "the letter", "a green door", "the bread",
            "the horse", "a blue kite", "the lamp"]
_PLACES = ["in the garden", "by the river", "at the market", "under the bridge", "near the old mill",
           "on the hill", "in the kitchen", "at night", "in the rain", "after dinner"]


def corpus(chars: int = 48_000, seed: int = CORPUS_SEED) -> str:
    """Sentences from a small grammar, ``chars`` characters long; the same text for the same seed."""
    rng = random.Random(seed)
    out: list[str] = []
    size = 0
    while size < chars:
        s, o, p = rng.choice(_SUBJECTS), rng.choice(_OBJECTS), rng.choice(_PLACES)
        kind = rng.random()
        if kind < 0.45:
            line = f"{s} {rng.choice(_TRANSITIVE)} {o} {p}."
        elif kind < 0.75:
            line = f"{s} {rng.choice(_INTRANSITIVE)} {p}."
        else:
            line = f"when {s} {rng.choice(_INTRANSITIVE)}, {rng.choice(_SUBJECTS)} {rng.choice(_TRANSITIVE)} {o}."
        out.append(line)
        size += len(line) + 1
    return "\n".join(out)[:chars]


class CharWindows(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """Windows of ``context + 1`` characters every ``stride`` characters: (input, next-char target, id)."""

    def __init__(self, text: str, context: int, stride: int) -> None:
        self.vocab = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.vocab)}
        self.data = torch.tensor([self.stoi[c] for c in text], dtype=torch.long)
        self.context = context
        self.stride = stride
        self.n = (len(self.data) - context - 1) // stride + 1
        if self.n < 1:
            raise SystemExit(f"text of {len(text)} characters is too short for --context {context}")

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        w = self.data[i * self.stride : i * self.stride + self.context + 1]
        return w[:-1], w[1:], i

    def decode(self, ids: list[int]) -> str:
        """Token ids back to text."""
        return "".join(self.vocab[i] for i in ids)


class Block(nn.Module):
    """Pre-norm transformer block: causal multi-head self-attention, then a GELU MLP."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))
        return x + self.drop(self.mlp(self.ln2(x)))


class TinyLM(nn.Module):
    """Token + position embeddings, ``layers`` blocks, final norm, output head tied to the embedding."""

    def __init__(self, vocab: int, context: int, dim: int, heads: int, layers: int, dropout: float) -> None:
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight
        for m in self.modules():  # small initial weights (GPT-2's): the tied head starts near uniform
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))

    @torch.no_grad()
    def generate(self, prompt: list[int], n: int) -> list[int]:
        """Greedy continuation of ``prompt`` by ``n`` tokens (eval mode; uses no RNG)."""
        was = self.training
        self.eval()
        ids = list(prompt)
        for _ in range(n):
            logits = self(torch.tensor([ids[-self.context:]]))
            ids.append(int(logits[0, -1].argmax()))
        self.train(was)
        return ids


def lr_factor(step: int, warmup: int, total: int, floor: float = 0.1) -> float:
    """Linear warmup over ``warmup`` steps, then cosine decay to ``floor`` at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build(vocab: int, args: argparse.Namespace, rank: int) -> tuple[TinyLM, torch.optim.AdamW, Any]:
    """Model, AdamW and LR schedule, identically initialized on every rank."""
    torch.manual_seed(args.seed)
    model = TinyLM(vocab, args.context, args.dim, args.heads, args.layers, args.dropout)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    warmup = max(1, args.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, warmup, args.steps))
    torch.manual_seed(args.seed + 1000 + rank)  # per-rank dropout streams: the RNG state must be per rank
    return model, opt, sched


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps in all (default 200)")
    ap.add_argument("--every-steps", type=int, default=25, help="interval checkpoint cadence (default 25)")
    ap.add_argument("--batch-size", type=int, default=16, help="sequences per rank per step (default 16)")
    ap.add_argument("--context", type=int, default=64, help="characters per sequence (default 64)")
    ap.add_argument("--stride", type=int, default=48, help="characters between sequence starts (default 48)")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--lr", type=float, default=1e-2, help="peak learning rate (default 1e-2)")
    ap.add_argument("--clip", type=float, default=1.0, help="gradient norm clip (default 1.0)")
    ap.add_argument("--workers", type=int, default=1, help="DataLoader worker processes per rank (default 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--text", default=None, help="train on this UTF-8 text file instead of the generated corpus")
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep after each step")
    ap.add_argument("--log", default=None, help="JSON-lines step log; %%r expands to the rank")
    ap.add_argument("--out", default=None, help="final state file; %%r expands to the rank")
    ap.add_argument("--grad-sync", choices=("auto", "ddp", "allreduce"), default="auto",
                    help="DDP, or one explicit all_reduce of the flattened gradients per step; auto: DDP up "
                         "to 2 ranks, all_reduce beyond")
    args = ap.parse_args(argv)
    logging.basicConfig(level=os.environ.get("RSLURM_LOG_LEVEL", "WARNING"), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s rank" + os.environ.get("RANK", "0")
                        + " %(name)s: %(message)s")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))

    rank, world, _ = init_distributed(backend="gloo")
    if args.text:
        with open(args.text, encoding="utf-8") as f:
            text = f.read()
    else:
        text = corpus()
    data = CharWindows(text, args.context, args.stride)
    sampler = ResumableSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        drop_last=True, persistent_workers=False)
    model, opt, sched = build(len(data.vocab), args, rank)
    # DDP with 3+ ranks is not bitwise reproducible across a restart: constructing DDP again changes the
    # float summation order of its first iteration's allreduce. With 2 ranks a sum is a + b either way.
    grad_sync = args.grad_sync if args.grad_sync != "auto" else ("ddp" if world <= 2 else "allreduce")
    use_ddp = world > 1 and grad_sync == "ddp"
    net: nn.Module = nn.parallel.DistributedDataParallel(model) if use_ddp else model
    state: dict[str, Any] = {"model": model, "optimizer": opt, "scheduler": sched, "sampler": sampler,
                             "progress": {"tokens_seen": 0}}

    ckpt = Checkpointer(every_steps=args.every_steps)
    step = ckpt.restore(state)
    log = open(args.log.replace("%r", str(rank)), "a") if args.log else None

    def record(entry: dict[str, Any]) -> None:
        if log:
            log.write(json.dumps(entry) + "\n")
            log.flush()

    record({"event": "start", "step": step, "pid": os.getpid(), "world_size": world, "t": time.time(),
            "restart_count": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
            "job_id": os.environ.get("SLURM_JOB_ID")})
    model.train()
    while step < args.steps and not ckpt.should_stop:
        sampler.set_epoch(sampler.epoch)  # track() moves to the next epoch when a pass ends
        for x, y, idx in sampler.track(loader):
            logits = net(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if world > 1 and not use_ddp:
                grads = [p.grad for p in model.parameters() if p.grad is not None]
                flat = torch.cat([g.reshape(-1) for g in grads])
                dist.all_reduce(flat)
                flat /= world
                for g, new in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                    g.copy_(new)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            lr = opt.param_groups[0]["lr"]
            opt.step()
            sched.step()
            step += 1
            state["progress"]["tokens_seen"] += x.numel() * world
            record({"step": step, "loss": loss.item(), "lr": lr, "epoch": sampler.epoch, "batch": idx.tolist()})
            ckpt.step(step, state)
            if args.step_sleep:
                time.sleep(args.step_sleep)
            if ckpt.should_stop or step >= args.steps:
                break
    ckpt.close()
    sample = None
    if step >= args.steps:
        if args.out:
            torch.save({"step": step, "model": model.state_dict(), "optimizer": opt.state_dict(),
                        "scheduler": sched.state_dict(), "progress": state["progress"],
                        "rng": torch.get_rng_state()}, args.out.replace("%r", str(rank)))
        if rank == 0:
            prompt = [data.stoi[c] for c in "the "]
            sample = data.decode(model.generate(prompt, 100))
            print(f"step {step}: the model writes: {sample!r}", flush=True)
    record({"event": "exit", "step": step, "stopped": ckpt.should_stop, "sample": sample, "t": time.time()})
    if log:
        log.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
