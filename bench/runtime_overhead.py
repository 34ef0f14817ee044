"""Runtime overhead: steps/s of Partita's generated program vs a hand-written torch program, same layout.

Four layouts on 4 CPU ranks (gloo) for a small Llama (HF ``LlamaForCausalLM`` from a config file):

* ``dp``    - 4 data-parallel replicas; hand-written: ``DistributedDataParallel`` (``no_sync`` while
  accumulating micro-batches);
* ``tp``    - tensor parallel over 4 ranks, Megatron placements; hand-written: ``parallelize_module``
  with ``ColwiseParallel`` (q/k/v/gate/up, and ``lm_head`` gathering its output) and
  ``RowwiseParallel`` (o/down);
* ``zero3`` - ZeRO-3 over 4 ranks; hand-written: ``fully_shard`` per decoder layer + the root;
* ``pp``    - 2 pipeline stages x 2 replicas, 1F1B; hand-written: two stage modules cut by hand,
  ``PipelineStage`` + ``Schedule1F1B`` per pp group, then one flattened gradient all-reduce per
  dp group.

Generated program ("A"): the plan is emitted by ``backends/torch/emit.py`` and run in the worker
through ``backends/torch/parallelize.build`` (the program's ``setup_stage_<i>`` / ``make_runner`` and
the step body of ``torch_train``'s loop), with collective counting on, as ``partita run`` does;
"A0" is the same with counting off. Hand-written ("B") uses public torch APIs only, not Partita;
same config, same seed (same initial weights: step-1 losses are compared), same batches.

One ``torchrun`` launch per layout builds A, A0 and B side by side and runs them in interleaved
blocks (A B A0, then A0 B A, ...); a block's step time is the median over its steps of the
slowest rank's time (barrier, forward + backward + sync + optimizer step), the first block of
each variant is a warm-up. Reported: the median over rounds of steps/s(A) / steps/s(B) with its
min..max, target >= 0.95. Writes ``bench/results/runtime_overhead.json`` and prints a table::

    python bench/runtime_overhead.py [--quick] [--rounds 5] [--steps 6] [--layouts dp,tp,zero3,pp]

The machine this ran on is shared with other jobs (2 cores for 4 ranks): absolute numbers are
noisy; interleaving and medians keep the ratio usable. Gloo proves nothing about GPU speed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "runtime_overhead.json"
LLAMA = {"model_type": "llama", "hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 4096, "max_position_embeddings": 256,
         "attention_dropout": 0.0, "use_cache": False}  # fmt: skip
QUICK = {**LLAMA, "hidden_size": 256, "intermediate_size": 640, "vocab_size": 2048}
TRAINING = {"global_batch": 16, "seq_len": 128, "dtype": "f32", "optimizer": "adamw", "lr": 1e-3}
LAYOUTS = ("dp", "tp", "zero3", "pp")
WORLD = 4


# ---- plans (driver side) -------------------------------------------------------------------
def make_plan(layout: str, num_layers: int) -> Any:
    from partita.cluster import parse_shorthand
    from partita.plan import Plan, Stage

    blocks = [f"model.layers.{i}" for i in range(num_layers)]
    layers = ["embed", *blocks, "head"]
    cl = parse_shorthand(f"{WORLD}xCPU")

    def stage(i: int, lay: list[str], ranks: list[int], dp: int, tp: int, zero: int = 0) -> Stage:
        pl: dict[str, tuple[str, str]] = {}
        if tp > 1:
            for b in (x for x in lay if x.startswith("model.layers.")):
                for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
                    pl[f"{b}.{p}.weight"] = ("R", "S(0)")
                pl[f"{b}.self_attn.o_proj.weight"] = ("R", "S(1)")
                pl[f"{b}.mlp.down_proj.weight"] = ("R", "S(1)")
            if "head" in lay:
                pl["lm_head.weight"] = ("R", "S(0)")
        return Stage(index=i, layers=tuple(lay), device_type="CPU", ranks=tuple(ranks), dp=dp, tp=tp,
                     zero_stage=zero, param_placements=pl)  # fmt: skip

    gb = TRAINING["global_batch"]
    if layout == "dp":
        stages, mb, m = (stage(0, layers, [0, 1, 2, 3], 4, 1),), gb // 8, 2
    elif layout == "tp":
        stages, mb, m = (stage(0, layers, [0, 1, 2, 3], 1, 4),), gb // 2, 2
    elif layout == "zero3":
        stages, mb, m = (stage(0, layers, [0, 1, 2, 3], 4, 1, zero=3),), gb // 8, 2
    else:
        half = 1 + num_layers // 2
        stages = (stage(0, layers[:half], [0, 1], 2, 1), stage(1, layers[half:], [2, 3], 2, 1))
        mb, m = gb // 8, 4
    return Plan(
        model={"name": "llama-bench", "framework": "torch", "layers": layers},
        cluster={"name": cl.name, "fingerprint": cl.fingerprint(), "spec": cl.to_dict()},
        training=dict(TRAINING),
        stages=stages,
        schedule="1f1b",
        micro_batch_size=mb,
        num_micro_batches=m,
        predicted={"step_time_s": 0.0},
        partita_version="0.1.0",
    )


# ---- the hand-written programs (worker side; public torch + transformers APIs only) ----------
def build_llama(cfg: dict[str, Any], seed: int) -> Any:
    import torch
    import transformers as T

    c = T.LlamaConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
    c.bos_token_id = c.eos_token_id = c.pad_token_id = None
    c._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device("cpu"):
        return T.LlamaForCausalLM(c)


def ce_loss(total: int) -> Any:
    import torch.nn.functional as F

    def fn(logits: Any, labels: Any) -> Any:
        logits = getattr(logits, "logits", logits)[:, :-1]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1), reduction="sum") / total  # fmt: skip

    return fn


class HandWritten:
    """One layout written the way a person would with torch.distributed; ``step(x, y)`` -> global loss."""

    def __init__(self, layout: str, cfg: dict[str, Any], m: int, seed: int) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        self.layout, self.m = layout, m
        self.rank, world = dist.get_rank(), dist.get_world_size()
        model = build_llama(cfg, seed)
        total = TRAINING["global_batch"] * (TRAINING["seq_len"] - 1)
        self.loss_fn = ce_loss(total)
        self.rows = slice(None)
        if layout == "dp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.model = DDP(model)
            self.rows, self.scale = self._rows(self.rank, world), float(world)  # DDP averages over replicas
        elif layout == "tp":
            from torch.distributed.tensor import Replicate
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            mesh = init_device_mesh("cpu", (world,))
            col, row = ColwiseParallel(), RowwiseParallel()
            for layer in model.model.layers:
                parallelize_module(layer, mesh, {"self_attn.q_proj": col, "self_attn.k_proj": col,
                                                 "self_attn.v_proj": col, "self_attn.o_proj": row,
                                                 "mlp.gate_proj": col, "mlp.up_proj": col, "mlp.down_proj": row})  # fmt: skip
            parallelize_module(model, mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})
            self.model, self.scale = model, 1.0
        elif layout == "zero3":
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world,))
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh, reshard_after_forward=True)
            self.model = fully_shard(model, mesh=mesh, reshard_after_forward=True)
            self.rows, self.scale = self._rows(self.rank, world), float(world)  # FSDP averages over replicas
        else:
            self._pipeline(model, m)
        params = self.stage_module.parameters() if layout == "pp" else self.model.parameters()
        self.opt = torch.optim.AdamW(params, lr=TRAINING["lr"], weight_decay=0.01)

    @staticmethod
    def _rows(replica: int, num: int) -> Any:
        return (replica, num)

    def _pipeline(self, model: Any, m: int) -> None:
        import torch
        import torch.distributed as dist
        from torch import nn
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        half = len(model.model.layers) // 2
        stage = 0 if self.rank < 2 else 1
        inner = model.model

        class Stage(nn.Module):
            def __init__(self, first: bool) -> None:
                super().__init__()
                self.first = first
                self.embed_tokens = inner.embed_tokens if first else None
                self.layers = nn.ModuleList(inner.layers[:half] if first else inner.layers[half:])
                self.rotary_emb = inner.rotary_emb
                self.norm = None if first else inner.norm
                self.lm_head = None if first else model.lm_head

            def forward(self, h: torch.Tensor) -> torch.Tensor:
                if self.first:
                    h = self.embed_tokens(h)
                pos = torch.arange(h.shape[1]).unsqueeze(0)
                cos, sin = self.rotary_emb(h, pos)
                for layer in self.layers:
                    h = layer(h, attention_mask=None, position_embeddings=(cos, sin), position_ids=pos)
                return h if self.first else self.lm_head(self.norm(h))

        self.stage_module = Stage(stage == 0)
        pp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        dp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        self.dp_group = dp_groups[stage]
        ps = PipelineStage(self.stage_module, stage, 2, torch.device("cpu"), group=pp_groups[self.rank % 2])
        self.schedule = Schedule1F1B(ps, n_microbatches=m, loss_fn=self.loss_fn, scale_grads=False)
        self.stage, self.rows, self.scale = stage, self._rows(self.rank % 2, 2), 1.0

    def _mine(self, t: Any) -> Any:
        """This replica's rows of every micro-batch, concatenated (micro-batch k = rows [k M, (k+1) M))."""
        import torch

        if self.rows == slice(None):
            return t
        i, n = self.rows
        mb = t.shape[0] // self.m
        share = mb // n
        return torch.cat([t[k * mb + i * share : k * mb + (i + 1) * share] for k in range(self.m)])

    def step(self, x: Any, y: Any) -> float:
        import contextlib

        import torch
        import torch.distributed as dist

        x, y = self._mine(x), self._mine(y)
        local = torch.zeros((), dtype=torch.float64)
        if self.layout == "pp":
            losses: list[Any] = []
            if self.stage == 0:
                self.schedule.step(x)
            else:
                self.schedule.step(target=y, losses=losses)
                local += sum(float(v) for v in losses)
            grads = [p.grad for p in self.stage_module.parameters() if p.grad is not None]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.dp_group)
            off = 0
            for g in grads:
                g.copy_(flat[off : off + g.numel()].view_as(g))
                off += g.numel()
        else:
            for k, (xk, yk) in enumerate(zip(x.chunk(self.m), y.chunk(self.m))):
                quiet = self.layout == "dp" and k < self.m - 1
                with self.model.no_sync() if quiet else contextlib.nullcontext():
                    loss = self.loss_fn(self.model(xk), yk)
                    (loss * self.scale).backward()
                local += float(loss.detach()) if (self.layout != "tp" or self.rank == 0) else 0.0
        self.opt.step()
        self.opt.zero_grad()
        dist.all_reduce(local)
        return float(local)


# ---- worker -----------------------------------------------------------------------------------
def make_batch(cfg: dict[str, Any], step: int) -> tuple[Any, Any]:
    import torch

    torch.manual_seed(1_000_003 + step)
    ids = torch.randint(0, cfg["vocab_size"], (TRAINING["global_batch"], TRAINING["seq_len"]))
    return ids, ids.clone()


def worker(args: argparse.Namespace) -> None:
    import dataclasses

    import torch
    import torch.distributed as dist

    from partita.backends.torch import parallelize as parallelize_torch
    from partita.backends.torch import train as torch_train
    from partita.models.zoo import resolve_model
    from partita.plan import Plan

    dist.init_process_group("gloo")
    cfg = json.loads(Path(args.config).read_text())
    plan = Plan.from_json(Path(args.plan).read_text())
    handle = dataclasses.replace(resolve_model(args.config), name=args.config)

    def generated(count: bool) -> tuple[Any, Any]:
        pm = parallelize_torch.build(
            handle.build("cpu", seed=0).float(), plan, handle, seq_len=TRAINING["seq_len"],
            where=Path(args.plan).parent, count_collectives=count,
        )  # fmt: skip
        return pm, torch_train.make_optimizer(pm.parameters(), TRAINING)

    variants: dict[str, Any] = {"A": generated(True), "A0": generated(False)}
    variants["B"] = HandWritten(args.layout, cfg, plan.num_micro_batches, seed=0)

    def one_step(name: str, step: int) -> tuple[float, float]:
        x, y = make_batch(cfg, step)
        dist.barrier()
        t0 = time.perf_counter()
        if name == "B":
            loss = variants["B"].step(x, y)
        else:
            pm, opt = variants[name]
            loss = float(pm.step(x, y))
            opt.step()
            opt.zero_grad()
        t = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t), loss

    first_loss = {n: one_step(n, 0)[1] for n in ("A", "A0", "B")}  # same weights, same batch: equal losses
    blocks: dict[str, list[float]] = {n: [] for n in variants}
    step = 1
    for r in range(args.rounds + 1):  # round 0 is the warm-up
        order = ("A", "B", "A0") if r % 2 == 0 else ("A0", "B", "A")
        for name in order:
            times = []
            for _ in range(args.steps):
                times.append(one_step(name, step)[0])
                step += 1
            if r > 0:
                blocks[name].append(statistics.median(times))
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps({"blocks": blocks, "first_loss": first_loss}))
    dist.destroy_process_group()


# ---- driver -----------------------------------------------------------------------------------
def run_layout(layout: str, cfg: dict[str, Any], args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from partita.backends.torch.emit import emit_torch

    d = tmp / layout
    d.mkdir(parents=True, exist_ok=True)
    config = tmp / "llama-bench.json"
    plan = make_plan(layout, cfg["num_hidden_layers"])
    (d / "plan.json").write_text(plan.to_json())
    (d / "program_torch.py").write_text(emit_torch(plan, str(config)))  # what `partita run` would launch
    out = d / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD), __file__, "--worker", "--layout", layout, "--config", str(config),
           "--plan", str(d / "plan.json"), "--out", str(out), "--rounds", str(args.rounds),
           "--steps", str(args.steps)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    for attempt in range(2):  # one retry: a gloo rank has aborted once in a while on this loaded machine
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if out.exists():
            break
        (d / f"worker_stderr_{attempt}.txt").write_text(proc.stderr)
        print(f"{layout}: worker failed (attempt {attempt + 1}):\n{proc.stderr[-1500:]}", file=sys.stderr)
    if proc.returncode != 0 and not out.exists():
        raise SystemExit(f"{layout}: worker failed\n{proc.stderr[-4000:]}")
    if proc.returncode != 0:  # results written, then a rank died at exit (seen with gloo + FSDP2 teardown)
        print(f"{layout}: worker exited {proc.returncode} after writing its results", file=sys.stderr)
    raw = json.loads(out.read_text())
    sps = {n: [1.0 / t for t in ts] for n, ts in raw["blocks"].items()}
    ratios = [a / b for a, b in zip(sps["A"], sps["B"])]
    ratios0 = [a / b for a, b in zip(sps["A0"], sps["B"])]
    losses = raw["first_loss"]
    return {
        "layout": layout,
        "step_time_s": {n: statistics.median(ts) for n, ts in raw["blocks"].items()},
        "steps_per_s": {n: statistics.median(v) for n, v in sps.items()},
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "ratio_nocount": statistics.median(ratios0),
        "ratios": ratios,
        "ratios_nocount": ratios0,
        "first_loss": losses,
        "same_loss": abs(losses["A"] - losses["B"]) <= 1e-4 * abs(losses["B"]) and losses["A"] == losses["A0"],
        "wall_s": time.perf_counter() - t0,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller model, 3 rounds of 3 steps")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6, help="steps per timed block")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--layout", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--plan", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.quick:
        args.rounds, args.steps = min(args.rounds, 3), min(args.steps, 3)
    cfg = QUICK if args.quick else LLAMA
    rows = []
    with tempfile.TemporaryDirectory(prefix="partita-overhead-") as tmp:
        (Path(tmp) / "llama-bench.json").write_text(json.dumps(cfg))
        for layout in args.layouts.split(","):
            rows.append(run_layout(layout, cfg, args, Path(tmp)))
            r = rows[-1]
            print(f"{layout}: ratio {r['ratio']:.3f} ({r['ratio_min']:.3f}..{r['ratio_max']:.3f})", flush=True)
    result = {
        "what": "steps/s of the generated program (A: counting on, A0: off) / hand-written torch (B), same layout",
        "world_size": WORLD,
        "model": cfg,
        "training": TRAINING,
        "quick": args.quick,
        "rounds": args.rounds,
        "steps_per_block": args.steps,
        "target_ratio": 0.95,
        "layouts": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"\n{'layout':7} {'A ms':>8} {'A0 ms':>8} {'B ms':>8} {'A/B steps/s':>12} {'min..max':>13} {'A0/B':>6} loss=")
    for r in rows:
        t = r["step_time_s"]
        print(f"{r['layout']:7} {t['A'] * 1e3:8.1f} {t['A0'] * 1e3:8.1f} {t['B'] * 1e3:8.1f} {r['ratio']:12.3f} "
              f"{r['ratio_min']:6.3f}..{r['ratio_max']:.3f} {r['ratio_nocount']:6.3f} {r['same_loss']}")  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
