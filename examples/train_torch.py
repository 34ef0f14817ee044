"""A user's PyTorch training script with Partita's one-line annotation.

    python examples/train_torch.py                     # plans, prints the torchrun command, trains on 1 device
    torchrun --standalone --nproc-per-node 4 examples/train_torch.py   # trains with the plan on 4 ranks
    torchrun --standalone --nproc-per-node 2 examples/train_torch.py   # any rank count: the plan is for 2xCPU
    python examples/train_torch.py --cluster 16xA100-80G  # plan for another cluster (a GPU run needs its GPUs)

The cluster is ``--cluster`` when given; else under torchrun one CPU rank per process (its world
size, ``NxCPU``), else ``4xCPU``. A ``--cluster`` whose device count is not torchrun's world size is
refused with one paragraph (exit 2) before anything runs.

It trains two models for a few steps: an MLP classifier and a tiny GPT-2 built from a
``transformers`` config. Every rank seeds the same way and draws the same global batch; Partita
keeps each rank's share. Rank 0 prints one JSON line per model: ``{"model", "losses", ...}``.
``--plan DIR`` trains the GPT-2 with a plan compiled elsewhere (``partita compile ... --out DIR``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import transformers
from torch import nn

import partita
from partita.cluster import parse_cluster
from partita.errors import ConfigError, PartitaError

DEFAULT_CLUSTER = "4xCPU"  # outside torchrun, with no --cluster


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


def resolve_cluster(cluster: str, env: dict[str, str] | os._Environ[str] = os.environ) -> str:
    """``--cluster`` if given, else one CPU rank per torchrun process (``WORLD_SIZE``), else 4xCPU.
    Raises a ``PartitaError`` (problem and fix) when ``--cluster`` does not match torchrun's world size."""
    world = env.get("WORLD_SIZE")
    if not cluster:
        return f"{int(world)}xCPU" if world else DEFAULT_CLUSTER
    count = parse_cluster(cluster).num_devices
    if world and count != int(world):
        raise ConfigError(
            f"--cluster {cluster} has {count} devices but torchrun started {world} ranks.",
            f"launch with --nproc-per-node {count}, or leave out --cluster to plan for {world}xCPU.",
        )
    return cluster


def train(name: str, model: nn.Module, batches: list, cluster: str, **plan: object) -> list[float]:
    model = partita.parallelize(model, cluster=cluster, **plan)  # <- the one line
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
    ap.add_argument(
        "--cluster", default="", help="cluster to plan for (default: torchrun's world size x CPU, else 4xCPU)"
    )
    args = ap.parse_args()
    try:
        run(args)
    except PartitaError as err:  # bad input: one paragraph and exit 2 on every rank, printed once
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"train_torch.py: error: {err}", file=sys.stderr, flush=True)
        sys.exit(err.exit_code)


def run(args: argparse.Namespace) -> None:
    count: dict[str, object] = {"count_collectives": True, "cluster": resolve_cluster(args.cluster)}
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
