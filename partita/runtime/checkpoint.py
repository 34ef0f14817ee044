"""Distributed checkpoints (DCP) of the generated program's model and optimizer, published atomically.

Called by ``torch_train.py`` every ``--checkpoint-every`` steps and on ``--resume``. Each save goes
to a fresh ``.tmp-step-NNNNNN`` directory; after every rank finished writing, rank 0 renames it to
``step-NNNNNN`` (an atomic rename on one file system), so a crash mid-save never leaves a directory
that :func:`latest` would pick. State dicts come from ``torch.distributed.checkpoint.state_dict``
with flattened optimizer state, so stages that hold different parameters save disjoint keys.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.optim import Optimizer

OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_STEP_DIR = re.compile(r"^step-(\d{6})$")


def save(root: str | Path, step: int, module: nn.Module, optimizer: Optimizer) -> Path:
    """Save after ``step`` optimizer steps; every rank calls this. Returns the published directory."""
    root = Path(root)
    tmp, final = root / f".tmp-step-{step:06d}", root / f"step-{step:06d}"
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(module, optimizer, options=OPTIONS)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    dist.barrier()
    if dist.get_rank() == 0:
        (tmp / "partita_step.json").write_text(json.dumps({"step": step}) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    dist.barrier()
    return final


def latest(root: str | Path) -> tuple[int, Path] | None:
    """The newest published checkpoint under ``root`` as (step, path), or None."""
    root = Path(root)
    if not root.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name))]
    return max(found) if found else None


def load(path: str | Path, module: nn.Module, optimizer: Optimizer) -> int:
    """Load a published checkpoint into ``module``/``optimizer`` in place; returns its step."""
    model_sd, optim_sd = get_state_dict(module, optimizer, options=OPTIONS)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=OPTIONS)
    return int(json.loads((Path(path) / "partita_step.json").read_text())["step"])
