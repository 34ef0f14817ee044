"""A user's PyTorch training script with Partita's one-line annotation.

    python examples/train_torch.py                     # plans, prints the torchrun command, trains on 1 device
    torchrun --standalone --nproc-per-node 4 examples/train_torch.py   # trains with the plan on 4 ranks

It trains two models for a few steps: an MLP classifier and a tiny GPT-2 built from a
``transformers`` config. Every rank seeds the same way and draws the same global batch; Partita
keeps each rank's share. Rank 0 prints one JSON line per model: ``{"model", "losses", ...}``.
``--plan DIR`` trains the GPT-2 with a plan compiled elsewhere (``partita compile ... --out DIR``).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import transformers
from torch import nn

import partita

CLUSTER = "4xCPU"


class MLP(nn.Module):
    def __init__(self, dim: int = 128, hidden: int = 512, num_classes: int = 16) -> None:
        super().__init__()
        self.fc1, self.act1 = nn.Linear(dim, hidden), nn.GELU()
        self.fc2, self.act2 = nn.Linear(hidden, hidden), nn.GELU()
        self.fc3 = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.act2(self.fc2(self.act1(self.fc1(x)))))


def tiny_gpt2() -> nn.Module:
    cfg = transformers.GPT2Config(
        n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=32,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


def train(name: str, model: nn.Module, batches: list, **plan: object) -> list[float]:
    model = partita.parallelize(model, cluster=CLUSTER, **plan)  # <- the one line
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, y in batches:
        loss = partita.step(model, x, y)  # forward + backward (the plan's schedule under torchrun)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    if int(os.environ.get("RANK", "0")) == 0:
        info = {"model": name, "losses": losses, "ranks": int(os.environ.get("WORLD_SIZE", "1"))}
        if hasattr(model, "plan"):  # the parallel model under torchrun
            info |= {"step_time_s": model.step_times, "collectives": model.collectives[-1:]}
            info |= {"predicted_collectives": model.rt.program["predicted_collectives"]}
        print(json.dumps(info), flush=True)
    return losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--model", choices=["mlp", "gpt2", "all"], default="all")
    ap.add_argument("--plan", default="", help="plan directory for the GPT-2 (skips the search)")
    args = ap.parse_args()
    count = {"count_collectives": True}
    if args.model in ("mlp", "all"):
        torch.manual_seed(0)
        teacher = torch.randn(128, 16)  # a learnable task: the class is the argmax of a fixed projection
        xs = [torch.randn(64, 128) for _ in range(args.steps)]
        batches = [(x, (x @ teacher).argmax(-1)) for x in xs]
        train("mlp", MLP(), batches, global_batch=64, seq_len=1, example_inputs=batches[0][0], dtype="f32", **count)
    if args.model in ("gpt2", "all"):
        torch.manual_seed(0)
        model = tiny_gpt2()
        # counting sequences from random starts: next-token prediction that a tiny model can learn
        ids = [(torch.randint(0, 128, (8, 1)) + torch.arange(32)) % 128 for _ in range(args.steps)]
        plan = {"plan": args.plan} if args.plan else {"global_batch": 8, "seq_len": 32, "dtype": "f32"}
        train("gpt2", model, [(t, t) for t in ids], **plan, **count)


if __name__ == "__main__":
    main()
