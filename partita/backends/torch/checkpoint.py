"""Distributed checkpoints (DCP) of the generated program's model and optimizer, published atomically.

Called by ``torch_train.py`` every ``--checkpoint-every`` steps, on ``--resume`` and when torchrun
restarts a failed job. Each save goes to a fresh ``.tmp-step-NNNNNN`` directory; after every rank
finished writing, rank 0 writes ``partita_step.json`` (fsynced), then renames the directory to
``step-NNNNNN`` (an atomic rename on one file system) and fsyncs the parent. A crash at any point
before the rename leaves only a ``.tmp-`` directory, which :func:`latest` never picks, so the
previous checkpoint stays the newest readable one.

``partita_step.json`` records the step, the losses so far, the model, the training config, the
world size and torchrun's run id: a restart resumes only its own run's checkpoints, and a resume
under a different plan (another world size or cluster: DCP reshards on load) is refused when the
model or training config differ. State dicts come from ``torch.distributed.checkpoint.state_dict``
with flattened optimizer state, so stages that hold different parameters save disjoint keys.

Strided shards (a plan's ``"SS(d,g)"``, GPT-2's q|k|v weight split per chunk) are not boxes of
the tensor, which is all DCP can store. They are saved as the exact view that makes them one: dim
``d`` factored into ``(g, n)``, sharded on ``n`` (no communication; the file holds the canonical
values). On load, a tensor whose stored shape is that factored view reads through the same view
when its own layout allows it (strided, or not sharded on ``d``); otherwise (a contiguous shard of
``d``, or a strided tensor meeting an unfactored file) it reads into a replicated buffer that is
then resliced to its layout.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.optim import Optimizer

from partita.errors import PlanError
from partita.frontends.torch_shim import strided_shard_spec

OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
META_FILE = "partita_step.json"
_STEP_DIR = re.compile(r"^step-(\d{6})$")
_TMP_DIR = re.compile(r"^\.tmp-step-(\d{6})$")


def save(
    root: str | Path,
    step: int,
    module: nn.Module,
    optimizer: Optimizer,
    meta: Mapping[str, Any] | None = None,
    before_publish: Callable[[], None] | None = None,
) -> Path:
    """Save after ``step`` optimizer steps; every rank calls this. Returns the published directory.

    ``meta`` is merged into ``partita_step.json``; ``before_publish`` runs on every rank after the
    data is written and before rank 0 publishes it (the fault-injection point of the tests).
    """
    root = Path(root)
    tmp, final = root / f".tmp-step-{step:06d}", root / f"step-{step:06d}"
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(module, optimizer, options=OPTIONS)
    state = {k: {n: _storage_view(v) for n, v in sd.items()} for k, sd in (("model", model_sd), ("optim", optim_sd))}
    dcp.save(state, checkpoint_id=str(tmp))
    dist.barrier()
    if before_publish is not None:
        before_publish()
    if dist.get_rank() == 0:
        _write_synced(tmp / META_FILE, json.dumps({**(meta or {}), "step": step}, sort_keys=True) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _fsync_dir(root)
        for p in root.iterdir():  # dead partial saves of earlier attempts
            if _TMP_DIR.match(p.name):
                shutil.rmtree(p, ignore_errors=True)
    dist.barrier()
    return final


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_meta(path: str | Path) -> dict[str, Any]:
    """The ``partita_step.json`` of a published checkpoint."""
    file = Path(path) / META_FILE
    try:
        meta = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise PlanError(
            f"checkpoint {path} has no readable {META_FILE} ({type(e).__name__}).",
            "remove that directory so the previous checkpoint is used, or pass a fresh --checkpoint-dir.",
        ) from None
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
        raise PlanError(f"checkpoint {path}: {META_FILE} has no step.", "remove that directory.")
    return meta


def published(root: str | Path) -> list[tuple[int, Path]]:
    """Every published checkpoint under ``root`` as (step, path), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name))]
    return sorted(p for p in found if (p[1] / META_FILE).is_file())


def latest(root: str | Path, run_id: str | None = None) -> tuple[int, Path] | None:
    """The newest published checkpoint under ``root`` as (step, path), or None; with ``run_id``, only
    checkpoints that run wrote (a torchrun restart must not pick up an older job's state)."""
    found = published(root)
    if run_id is not None:
        found = [f for f in found if _run_id(f[1]) == run_id]
    return found[-1] if found else None


def _run_id(path: Path) -> str | None:
    try:
        return read_meta(path).get("run_id")
    except PlanError:
        return None


# Training fields that must agree for a checkpoint to continue the same run under another plan.
SAME_RUN_FIELDS = ("global_batch", "seq_len", "optimizer", "lr")


def resume_point(
    root: str | Path, program: Mapping[str, Any], *, resume: bool, restart: int, run_id: str
) -> tuple[int, Path] | None:
    """Which checkpoint the program continues from: the newest under ``root`` on ``--resume``, this
    run's newest on a torchrun restart, else None. Refuses one written for another model or training
    config (another world size or cluster is fine: that is re-planning, DCP reshards)."""
    found = latest(root) if resume else latest(root, run_id=run_id) if restart > 0 else None
    if found is None:
        return None
    meta = read_meta(found[1])
    theirs, mine = meta.get("training", {}), program.get("training", {})
    diff = [k for k in SAME_RUN_FIELDS if k in theirs and k in mine and theirs[k] != mine[k]]
    if "model" in meta and meta["model"] != program.get("model"):
        diff.insert(0, "model")
    if diff:
        got = {k: meta.get(k, theirs.get(k)) for k in diff}
        want = {k: program.get(k, mine.get(k)) for k in diff}
        raise PlanError(
            f"checkpoint {found[1]} was written by another run ({got}); this plan trains {want}.",
            "resume with a plan compiled for the same model and training config (only the cluster and world "
            "size may change), or pass a fresh --checkpoint-dir.",
        )
    return found


def load(path: str | Path, module: nn.Module, optimizer: Optimizer) -> int:
    """Load a published checkpoint into ``module``/``optimizer`` in place (DCP reshards to the
    current layout); returns its step."""
    step = int(read_meta(path)["step"])
    model_sd, optim_sd = get_state_dict(module, optimizer, options=OPTIONS)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    try:
        stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        reads = {top: {n: _reader(v, stored.get(f"{top}.{n}")) for n, v in sd.items()} for top, sd in state.items()}
        dcp.load({top: {n: r[0] for n, r in sd.items()} for top, sd in reads.items()}, checkpoint_id=str(path))
        for sd in reads.values():
            for buf, finish in sd.values():
                if finish is not None:
                    finish(buf)
    except Exception as e:  # noqa: BLE001 - DCP raises many types (CheckpointException, KeyError, OSError)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise PlanError(
            f"checkpoint {path} cannot be loaded into this plan's model ({type(e).__name__}: {first}).",
            "resume with the model and optimizer that wrote it, or remove it so the previous one is used.",
        ) from None
    set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=OPTIONS)
    return step


# ---- strided shards (module docstring) ------------------------------------------------------
def _strided(v: Any) -> tuple[int, int, int] | None:
    """(mesh dim, tensor dim, groups) of a DTensor's strided-shard placement, else None."""
    if not isinstance(v, DTensor):
        return None
    for i, p in enumerate(v.placements):
        if (spec := strided_shard_spec(p)) is not None:
            return i, *spec
    return None


def _factored(shape: tuple[int, ...], d: int, g: int) -> tuple[int, ...]:
    return (*shape[:d], g, shape[d] // g, *shape[d + 1 :])


def _shifted(v: DTensor, d: int, mesh_dim: int | None) -> list[Any]:
    """``v``'s placements on the view that factors dim ``d`` (the strided one becomes Shard(d+1))."""
    out: list[Any] = []
    for i, p in enumerate(v.placements):
        k = getattr(p, "dim", None)
        out.append(Shard(d + 1) if i == mesh_dim else Shard(k + 1) if k is not None and k > d else p)
    return out


def _view(v: DTensor, d: int, g: int, mesh_dim: int | None) -> DTensor:
    """The factored view of ``v`` sharing its local storage (dim ``d`` strided on ``mesh_dim``, or unsharded)."""
    local = v.to_local()
    shape = _factored(tuple(v.shape), d, g)
    return DTensor.from_local(
        local.view(_factored(tuple(local.shape), d, g)),
        v.device_mesh,
        _shifted(v, d, mesh_dim),
        run_check=False,
        shape=torch.Size(shape),
        stride=torch.empty(shape, device="meta").stride(),
    )


def _storage_view(v: Any) -> Any:
    """What DCP saves for ``v``: a strided shard as its factored view, anything else as is."""
    st = _strided(v)
    if st is None:
        return v
    mesh_dim, d, g = st
    return _view(v, d, g, mesh_dim)


def _reader(v: Any, meta: Any) -> tuple[Any, Callable[[Any], None] | None]:
    """(what DCP loads into, how its content then reaches ``v``) for one state-dict value."""
    size = tuple(getattr(meta, "size", ()) or ())
    if not isinstance(v, torch.Tensor) or not size:
        return v, None
    shape, st = tuple(v.shape), _strided(v)
    if size == shape and st is None:
        return v, None
    fac = next(
        ((d, size[d]) for d in range(len(shape)) if len(size) == len(shape) + 1 and size[d] and
         _factored(shape, d, size[d]) == size),
        None,
    )  # fmt: skip
    if fac is not None:
        d, g = fac
        if not isinstance(v, DTensor):
            return v.view(size), None
        sharded_d = [i for i, p in enumerate(v.placements) if getattr(p, "dim", None) == d]
        if st is not None and st[1] == d and st[2] == g and sharded_d == [st[0]]:
            return _view(v, d, g, st[0]), None
        if not sharded_d:
            return _view(v, d, g, None), None
    if not isinstance(v, DTensor):
        return v, None  # a shape DCP itself reports
    # replicated buffer of the stored shape, then resliced to v's layout
    buf = DTensor.from_local(
        torch.zeros(size, dtype=v.dtype, device=v.to_local().device),
        v.device_mesh,
        [Replicate()] * v.device_mesh.ndim,
        run_check=False,
    )

    def finish(b: Any) -> None:
        full = b.to_local().reshape(shape)
        rep = DTensor.from_local(full, v.device_mesh, [Replicate()] * v.device_mesh.ndim, run_check=False)
        with torch.no_grad():
            v.to_local().copy_(rep.redistribute(v.device_mesh, v.placements).to_local())

    return buf, finish
