"""The same script in one process or one process per device:

    python examples/train_anywhere.py                                  # 2 logical devices, in-process
    torchrun --standalone --nproc-per-node 2 examples/train_anywhere.py  # 2 processes over gloo (NCCL on GPUs)

Every rank prints the same losses as the in-process run.
"""

from __future__ import annotations

import functools
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging as hf_logging

import stagewise as sw


def main() -> None:
    hf_logging.set_verbosity_error()
    torch.manual_seed(0)  # every rank builds the same model and batches
    config = GPT2Config(n_layer=4, n_embd=32, n_head=4, vocab_size=128, n_positions=32,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    batches = [torch.randint(0, 128, (8, 16)) for _ in range(3)]
    pipe = sw.compile(model, 2, {"input_ids": batches[0], "labels": batches[0]}, microbatches=4,
                      schedule="1f1b", optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
    rank = os.environ.get("RANK", "-")
    for step, ids in enumerate(batches):
        loss = pipe.step(input_ids=ids, labels=ids)
        print(f"rank {rank} step {step} loss {float(loss):.6f}", flush=True)


if __name__ == "__main__":
    main()
