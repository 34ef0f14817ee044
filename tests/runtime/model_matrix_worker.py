"""One torchrun launch that trains many (model, plan) jobs: the worker of ``test_model_matrix.py``.

``python -m torch.distributed.run --nproc-per-node N tests/runtime/model_matrix_worker.py JOBS OUT``:
every rank joins one gloo group; the seeded single-device references, one per (model, training, steps)
that the jobs share, are split over the ranks (``train.reference_run``, reference ``i`` on rank ``i % N``);
then each job's plan is emitted (``backends/torch/emit.py``), executed in memory and trained by
``train._train``, exactly as the generated program's ``__main__`` would, one job after another on the same group. Rank 0 writes
``{job id: {"losses", "reference", "seconds", "num_stages"}}`` to OUT; a job with ``"count"`` also
counts collectives (the program's own first/last-step count against the plan's records, and every
rank's all_to_all over the run: their bytes follow the routing, only the group's sum is fixed).
"""

from __future__ import annotations

import datetime
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main(jobs_file: str, out_file: str) -> None:
    from partita.backends.torch import fidelity
    from partita.backends.torch import train as torch_train
    from partita.backends.torch.emit import emit_torch
    from partita.plan import Plan

    jobs = json.loads(Path(jobs_file).read_text())
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=180))
    rank, world = dist.get_rank(), dist.get_world_size()
    # one single-device run per (model, training, steps): the layouts of a model share it
    keys = {job["id"]: _reference_key(job) for job in jobs}
    first = {k: next(j for j in jobs if keys[j["id"]] == k) for k in dict.fromkeys(keys.values())}
    wants = {k for j in jobs if j.get("parity") for k in (keys[j["id"]],)}
    mine = {}
    for i, (key, job) in enumerate(first.items()):
        if i % world == rank:
            training = json.loads(job["plan"])["training"]
            parity = key in wants  # per-parameter: step-1 gradients, parameters after the last step
            ref = torch_train.reference_run(
                job["spec"], training, job["steps"], dump_steps=[1] if parity else [], params=parity
            )
            mine[key] = ref["losses"]
            if parity:
                where = Path(jobs_file).parent / f"reference{list(first).index(key)}"
                where.mkdir(parents=True, exist_ok=True)
                torch.save({"grads": ref["grads"][1], "params": ref["params"]}, where / "reference.pt")
    every: list = [None] * world
    dist.all_gather_object(every, mine)
    by_key = {k: v for part in every for k, v in part.items()}
    refs = {job_id: by_key[k] for job_id, k in keys.items()}
    ref_dirs = {job_id: Path(jobs_file).parent / f"reference{list(first).index(k)}" for job_id, k in keys.items()}
    out = {}
    for job in jobs:
        plan = Plan.from_json(job["plan"], f"matrix job {job['id']}")
        if job.get("api"):
            t0 = time.perf_counter()
            losses = _api_job(job, plan)
            if rank == 0:
                out[job["id"]] = {"losses": losses, "reference": refs[job["id"]], "seconds": time.perf_counter() - t0}
                out[job["id"]]["num_stages"] = plan.num_stages
                print(f"matrix: {job['id']} {out[job['id']]['seconds']:.2f}s", flush=True)
            continue
        where = Path(jobs_file).parent / job["id"]
        where.mkdir(parents=True, exist_ok=True)
        path = where / "program_torch.py"
        ns = {"__name__": "partita_matrix", "__file__": str(path)}
        exec(compile(emit_torch(plan, job["spec"]), str(path), "exec"), ns)  # noqa: S102 - our emitted source
        count = [] if job.get("count") else ["--no-count"]  # counted: the first and last step's collectives
        if job.get("parity"):  # every stage's (0, 0) rank dumps full gradients at step 1 and the last parameters
            count += ["--dump-grads", str(where / "grads"), "--dump-steps", "1", "--dump-params", str(where / "params")]
            count += ["--deterministic"]
        args = torch_train.parse_args(["--steps", str(job["steps"]), *count, "--checkpoint-every", "0"])
        t0 = time.perf_counter()
        every_a2a = None
        with fidelity.CollectiveCounter(enabled=bool(job.get("count"))) as outer:  # every rank's all_to_all
            res = torch_train._train(ns["PROGRAM"], ns["SETUP_STAGE"], ns["make_runner"], ns["lr_lambda"], args, "gloo")
        if job.get("count"):
            a2a = [nbytes for kind, _, nbytes in outer.events if kind == "all_to_all"]
            every_a2a = [None] * world
            dist.all_gather_object(every_a2a, {"count": len(a2a), "bytes": sum(a2a)})
        if rank == 0 and res is not None:
            out[job["id"]] = {
                "losses": res["losses"],
                "reference": refs[job["id"]],
                "seconds": time.perf_counter() - t0,
                "num_stages": plan.num_stages,
            }
            if job.get("parity"):
                training = json.loads(job["plan"])["training"]
                out[job["id"]]["parity"] = _parity(where, ref_dirs[job["id"]], training, job["steps"])
            if job.get("count"):  # the last step on each stage's first rank, and all_to_all per rank (whole run)
                out[job["id"]]["collectives"] = res["collectives"]
                out[job["id"]]["collective_mismatches"] = res["collective_mismatches"]
                out[job["id"]]["all_to_all_per_rank"] = every_a2a
            print(f"matrix: {job['id']} {out[job['id']]['seconds']:.2f}s", flush=True)
    if rank == 0:
        Path(out_file).write_text(json.dumps(out, indent=1))
    dist.barrier()
    from partita.backends.torch.parallel import leave_process_group

    leave_process_group()  # skips interpreter finalization, where gloo aborts now and then


def _reference_key(job: dict) -> str:
    """Jobs that train the same model the same way (spec, training settings, steps) have one reference."""
    return json.dumps([job["spec"], json.loads(job["plan"])["training"], job["steps"]], sort_keys=True)


def _parity(where: Path, reference: Path, training: dict, steps: int) -> list[dict]:
    """Every parameter's step-1 gradient and last value against the reference (``parity.compare``)."""
    from partita.backends.torch import parity

    ref = torch.load(reference / "reference.pt", weights_only=True)
    dtype = str(training.get("dtype", "f32"))
    grads = parity.load_dumps(str(where / "grads"), "grads_step1_rank*.pt")
    rows = parity.compare(grads, ref["grads"], "grad@1", dtype)
    got = parity.load_dumps(str(where / "params"), "params_rank*.pt")
    noise = parity.adam_noise(training, ref["grads"], grads)  # Adam's updates of float-noise gradients: left out
    rows += parity.compare(got, ref["params"], f"param@{steps}", dtype, noise)
    return parity.as_json(rows)


def _api_job(job: dict, plan: object) -> list[float]:
    """The user's way in: ``partita.parallelize(model, plan=...)`` on a live module, ``partita.step``,
    the user's own optimizer loop; weights and batches as the reference draws them."""
    import partita
    from partita.backends.torch import materialize
    from partita.backends.torch import train as torch_train
    from partita.models import resolve_model

    handle = resolve_model(job["spec"])
    training = json.loads(job["plan"])["training"]
    model = materialize.materialize(handle, 0).model
    sample = {k: v for k, v in handle.example_inputs(1, int(training["seq_len"]), "cpu").items()}
    pm = partita.parallelize(model, plan=plan, example_inputs=sample, verbose=False)
    opt = torch_train.make_optimizer(pm.parameters(), training)
    losses = []
    for step in range(job["steps"]):
        x, y = torch_train.make_batch(handle, training, 0, step)
        losses.append(float(partita.step(pm, x, y)))
        opt.step()
        opt.zero_grad()
    return losses


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
