"""Fine-tune a small Hugging Face GPT-2 on 4 CPU devices with an ordinary training loop.

    python examples/finetune.py                            # GPT-2 "small" preset, 60 steps
    python examples/finetune.py --size tiny --steps 20     # seconds
    python examples/finetune.py --stop-after 30            # "interrupted" after step 30 (its checkpoint written)
    python examples/finetune.py --resume                   # ...continued from the latest checkpoint: the same curve

What it does is what a fine-tuning script does with plain PyTorch or Hugging Face Trainer:
variable-length token sequences padded per batch (attention_mask, labels -100 on padding), a last
batch shorter than the others, dropout 0.1, AdamW without weight decay on biases and LayerNorm
weights, linear warmup then cosine decay, gradient clipping, bf16 autocast, validation every N
steps and a checkpoint every N steps that `--resume` continues from. The model is built from a
config with random weights (no download) and the data is synthetic but text-like (a Markov chain
over a Zipf-distributed vocabulary), so the loss has something to learn.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging as hf_logging

import stagewise as sw

PAD = 0  # GPT-2 has no pad token: token 0 pads, and the labels mark padding with -100 instead
IGNORE = -100  # what cross_entropy (and the model's own loss) ignores
LATEST = Path("<latest>")  # --resume without a folder
SIZES = {  # (layers, width, heads, vocabulary); "gpt2" is the real GPT-2 small (124M parameters)
    "tiny": (4, 32, 4, 128),
    "small": (6, 128, 4, 1024),
    "gpt2": (12, 768, 12, 50257),
}


@dataclass
class FinetuneConfig:
    """Every knob of the run (the command line sets them)."""

    size: str = "small"
    devices: int = 4
    microbatches: int = 4
    batch_size: int = 8
    min_length: int = 16  # each sequence's length is drawn from [min_length, max_length]
    max_length: int = 48
    train_sequences: int = 206  # not a multiple of batch_size: the last batch of an epoch is shorter
    validation_sequences: int = 36
    steps: int = 60  # the schedule's length
    warmup_steps: int = 6
    lr: float = 1e-3
    weight_decay: float = 0.01
    dropout: float = 0.1
    clip_grad_norm: float = 1.0
    precision: str = "bf16"
    eval_every: int = 20
    save_every: int = 20
    checkpoint: Path = Path("checkpoints/finetune")  # one folder per checkpoint in it: step-20, step-40, ...
    resume: Path | None = None  # a checkpoint folder to continue from
    stop_after: int | None = None  # leave after this step (as if interrupted), its checkpoint written
    seed: int = 0
    quiet: bool = False


@dataclass
class History:
    """What the run measured, step by step (the test compares it with eager PyTorch)."""

    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    validation: dict[int, float] = field(default_factory=dict)  # step -> validation loss


# --- the model -------------------------------------------------------------------------------------

def build_model(config: FinetuneConfig) -> GPT2LMHeadModel:
    """GPT-2 from a config, random weights seeded by config.seed (the test builds the same one)."""
    layers, width, heads, vocabulary = SIZES[config.size]
    torch.manual_seed(config.seed)
    gpt_config = GPT2Config(n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocabulary,
                            n_positions=max(64, config.max_length), bos_token_id=PAD, eos_token_id=PAD,
                            resid_pdrop=config.dropout, embd_pdrop=config.dropout, attn_pdrop=config.dropout)
    return GPT2LMHeadModel(gpt_config).train()  # train mode: dropout on (pipe.eval() / evaluate turn it off)


def no_decay_groups(named_parameters: list[tuple[str, torch.nn.Parameter]]) -> list[dict]:
    """Hugging Face Trainer's groups: no weight decay on biases and LayerNorm weights. A module-level
    function, because the checkpoint stores it (sw.ParamGroups pickles it)."""
    def exempt(name: str) -> bool:
        return name.endswith(".bias") or ".ln_" in name

    return [{"params": [n for n, _ in named_parameters if not exempt(n)]},
            {"params": [n for n, _ in named_parameters if exempt(n)], "weight_decay": 0.0}]


def warmup_cosine(step: int, warmup: int, total: int) -> float:
    """The learning rate's factor at `step`: linear warmup from 0, then cosine decay to 0."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def schedule(optimizer: torch.optim.Optimizer, config: FinetuneConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """The LR schedule over any optimizer: pipe.optimizer here, torch's own in the eager reference."""
    factor = functools.partial(warmup_cosine, warmup=config.warmup_steps, total=config.steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# --- the data --------------------------------------------------------------------------------------

def synthetic_corpus(count: int, config: FinetuneConfig, seed: int) -> list[torch.Tensor]:
    """Text-like sequences: each token follows the previous one through a fixed sparse transition
    table over a Zipf-distributed vocabulary (frequent words, likely successors), lengths varying."""
    vocabulary = SIZES[config.size][3]
    table = torch.Generator().manual_seed(1234)  # one "language" for every split
    zipf = 1.0 / torch.arange(1, vocabulary, dtype=torch.float64)
    successors = torch.multinomial(zipf.expand(vocabulary, -1), 8, generator=table) + 1  # 8 per token
    draw = torch.Generator().manual_seed(seed)
    corpus = []
    for _ in range(count):
        length = int(torch.randint(config.min_length, config.max_length + 1, (), generator=draw))
        tokens = [int(torch.randint(1, vocabulary, (), generator=draw))]
        for choice in torch.randint(0, 8, (length - 1,), generator=draw).tolist():
            tokens.append(int(successors[tokens[-1], choice]))
        corpus.append(torch.tensor(tokens))
    return corpus


def pad_batch(sequences: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The collate_fn: pad to this batch's longest sequence; padding is masked out of attention and
    labelled -100 so the loss ignores it (the model shifts the labels itself)."""
    longest = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), longest), PAD)
    attention_mask = torch.zeros((len(sequences), longest), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        input_ids[row, :len(sequence)] = sequence
        attention_mask[row, :len(sequence)] = 1
    labels = input_ids.masked_fill(attention_mask == 0, IGNORE)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def train_batches(corpus: list[torch.Tensor], config: FinetuneConfig, start: int) -> Iterator[tuple[int, dict]]:
    """(step, batch) from step `start` to config.steps, epoch after epoch. Each epoch's order comes
    from a generator seeded by the epoch, so a resumed run sees the batches an uninterrupted one does."""
    per_epoch = math.ceil(len(corpus) / config.batch_size)
    step = start
    for epoch in itertools.count(start // per_epoch):
        order = torch.Generator().manual_seed(config.seed + epoch)
        loader = DataLoader(corpus, batch_size=config.batch_size, shuffle=True, generator=order, collate_fn=pad_batch)
        for batch in itertools.islice(loader, step - epoch * per_epoch, None):
            if step == config.steps:
                return
            yield step, batch
            step += 1


def counted_tokens(batch: dict[str, torch.Tensor]) -> int:
    """The tokens the loss averages over (the model drops each row's first label)."""
    return int((batch["labels"][:, 1:] != IGNORE).sum())


def largest_batch(config: FinetuneConfig) -> dict[str, torch.Tensor]:
    """The compile example: the largest batch the loader makes (batch_size x max_length). The
    pipeline plans its memory for this shape and takes smaller batches and shorter sequences."""
    ids = torch.ones((config.batch_size, config.max_length), dtype=torch.long)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


# --- the training loop -----------------------------------------------------------------------------

def validate(pipe: sw.Pipeline, loader: DataLoader) -> float:
    """The token mean of the loss over the whole validation set (eval mode: dropout off)."""
    total = tokens = 0.0
    for batch in loader:
        count = counted_tokens(batch)
        total += float(pipe.evaluate(**batch)) * count  # evaluate: the batch's token mean, forward only
        tokens += count
    return total / tokens


def start(config: FinetuneConfig) -> tuple[sw.Pipeline, torch.optim.lr_scheduler.LambdaLR, int]:
    """A new pipeline at step 0, or the checkpoint's with its scheduler and step (--resume)."""
    if config.resume is not None:
        pipe = sw.load(config.resume)  # weights, optimizer state, step count, random streams
        scheduler = schedule(pipe.optimizer, config)
        pipe.load_scheduler(scheduler)  # the scheduler's position and the learning rates it had set
        return pipe, scheduler, pipe.extra["step"]
    pipe = sw.compile(
        build_model(config), config.devices, largest_batch(config),
        optimizer=sw.ParamGroups(torch.optim.AdamW, no_decay_groups, lr=config.lr, weight_decay=config.weight_decay),
        microbatches=config.microbatches,
        clip_grad_norm=config.clip_grad_norm,
        loss_reduction=sw.TokenMean(ignore_index=IGNORE, labels="labels", shift=True),  # eager's token mean
        precision=config.precision,
        seed=config.seed,  # keys dropout's random streams
    )
    return pipe, schedule(pipe.optimizer, config), 0


def finetune(config: FinetuneConfig) -> tuple[sw.Pipeline, History]:
    """Train from step 0 (or the checkpoint) to config.steps; returns the pipeline and what it measured."""
    train_set = synthetic_corpus(config.train_sequences, config, seed=config.seed)
    validation = DataLoader(synthetic_corpus(config.validation_sequences, config, seed=config.seed + 10_000),
                            batch_size=config.batch_size, collate_fn=pad_batch)
    pipe, scheduler, first = start(config)
    history = History()
    for step, batch in train_batches(train_set, config, first):
        lr = scheduler.get_last_lr()[0]
        loss = float(pipe.step(**batch))  # forward, backward, clipping and AdamW on every stage
        scheduler.step()  # reaches every stage's optimizer at the next pipe.step
        history.steps.append(step)
        history.losses.append(loss)
        history.lrs.append(lr)
        history.grad_norms.append(pipe.last_grad_norm)  # before clipping, as clip_grad_norm_ returns it
        report(config, f"step {step + 1:4d}  loss {loss:.4f}  lr {lr:.2e}  grad norm {pipe.last_grad_norm:.3f}  "
                       f"batch {tuple(batch['input_ids'].shape)}")
        done = step + 1
        if done % config.eval_every == 0 or done == config.steps:
            history.validation[done] = validate(pipe, validation)
            report(config, f"validation after step {done}: loss {history.validation[done]:.4f}")
        if done % config.save_every == 0:
            pipe.save(config.checkpoint / f"step-{done}", scheduler=scheduler, extra={"step": done})
        if done == config.stop_after:
            break
    return pipe, history


def report(config: FinetuneConfig, line: str) -> None:
    if not config.quiet:
        print(line, flush=True)


def where_the_time_went(pipe: sw.Pipeline) -> None:
    """The last step's busy seconds per device and stream (pipe.time_breakdown())."""
    print("last step, busy seconds per device: compute / p2p in / p2p out / swap in / swap out (of the step)")
    for row in pipe.time_breakdown():
        print(f"  device {row['device']}: {row['compute_s']:.3f} / {row['p2p_in_s']:.3f} / {row['p2p_out_s']:.3f} "
              f"/ {row['swap_in_s']:.3f} / {row['swap_out_s']:.3f}  (step {row['step_s']:.3f} s)")


def parse_args(argv: list[str] | None = None) -> FinetuneConfig:
    defaults = FinetuneConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default=defaults.size)
    p.add_argument("--steps", type=int, default=defaults.steps)
    p.add_argument("--batch-size", type=int, default=defaults.batch_size)
    p.add_argument("--precision", choices=["bf16", "fp32"], default=defaults.precision)
    p.add_argument("--dropout", type=float, default=defaults.dropout)
    p.add_argument("--eval-every", type=int, default=defaults.eval_every)
    p.add_argument("--save-every", type=int, default=defaults.save_every)
    p.add_argument("--checkpoint", type=Path, default=defaults.checkpoint)
    p.add_argument("--resume", nargs="?", type=Path, const=LATEST,
                   help="continue from this checkpoint folder (alone: the latest under --checkpoint)")
    p.add_argument("--stop-after", type=int, help="leave after this step, as if interrupted")
    args = p.parse_args(argv)
    if args.resume == LATEST:
        args.resume = latest_checkpoint(args.checkpoint)
    return FinetuneConfig(**{k: v for k, v in vars(args).items() if v is not None})


def latest_checkpoint(folder: Path) -> Path:
    """The checkpoint of the latest step under `folder` (step-<n> folders)."""
    saved = sorted(folder.glob("step-*"), key=lambda path: int(path.name.removeprefix("step-")))
    if not saved:
        raise SystemExit(f"--resume: no checkpoint under {folder}; train without --resume first")
    return saved[-1]


def main() -> None:
    hf_logging.set_verbosity_error()
    config = parse_args()
    # 4 devices in one process, each computing on its own thread: give each its share of the cores
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // config.devices))
    pipe, _ = finetune(config)
    where_the_time_went(pipe)


if __name__ == "__main__":
    main()
