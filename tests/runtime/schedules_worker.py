"""One torchrun launch that trains many pipeline-schedule jobs: the worker of ``test_schedules_runtime.py``.

``python -m torch.distributed.run --nproc-per-node N tests/runtime/schedules_worker.py JOBS OUT``:
every rank joins one gloo group; each job's plan is emitted (``backends/torch/emit.py``), executed in
memory and trained by ``train._train`` exactly as the generated program's ``__main__`` would (one job
after another on the same group, counting collectives in the first and last step), dumping full
gradients after steps 1 and 2 under ``JOBS``'s folder. Rank 0 writes, per job id, the losses, the
counted and predicted collectives, the program's mismatches and the ``ACTIONS`` the program printed.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import torch.distributed as dist


def main(jobs_file: str, out_file: str) -> None:
    from partita.backends.torch import train as torch_train
    from partita.backends.torch.emit import emit_torch
    from partita.plan import Plan

    jobs = json.loads(Path(jobs_file).read_text())
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=180))
    out = {}
    for job in jobs:
        plan = Plan.from_json(job["plan"], f"schedule job {job['id']}")
        where = Path(jobs_file).parent / job["id"]
        where.mkdir(parents=True, exist_ok=True)
        path = where / "program_torch.py"
        src = emit_torch(plan, job["spec"])
        ns = {"__name__": "partita_schedules", "__file__": str(path)}
        exec(compile(src, str(path), "exec"), ns)  # noqa: S102 - our emitted source
        argv = ["--steps", str(job["steps"]), "--checkpoint-every", "0", "--log-every", "0"]
        argv += ["--dump-grads", str(where / "g"), "--dump-steps", ",".join(map(str, range(1, job["steps"] + 1)))]
        args = torch_train.parse_args(argv)
        res = torch_train._train(ns["PROGRAM"], ns["SETUP_STAGE"], ns["make_runner"], ns["lr_lambda"], args, "gloo")
        if dist.get_rank() == 0 and res is not None:
            keys = ("losses", "collectives", "predicted_collectives", "collective_mismatches")
            out[job["id"]] = {k: res[k] for k in keys} | {"program": src}
            print(f"schedules: {job['id']} done", flush=True)
        dist.barrier()
    if dist.get_rank() == 0:
        Path(out_file).write_text(json.dumps(out, indent=1))
    dist.barrier()
    from partita.backends.torch.parallel import leave_process_group

    leave_process_group()  # skips interpreter finalization, where gloo aborts now and then


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
