"""Run several generated JAX programs in one process (tests only: saves a JAX start-up per plan).

``python run_programs.py STEPS OUT_DIR PLAN_DIR...`` imports each ``PLAN_DIR/program_jax.py``, trains its
``PROGRAM`` (``backends/jax/train.train``) and, once per (model, global batch, sequence), the
single-device reference; writes ``OUT_DIR/<name>.json`` (losses, the fidelity report: measured and
predicted collectives, mismatches) and ``OUT_DIR/<name>_{params,grads}.npz``, and the reference's as
``OUT_DIR/<name>_reference*``. The parent sets JAX_NUM_CPU_DEVICES.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

from partita.backends.jax import parallel as jp
from partita.backends.jax import train as jax_train


def main() -> None:
    steps, out = int(sys.argv[1]), Path(sys.argv[2])
    refs: dict[tuple[str, int, int], str] = {}
    for i, d in enumerate(sys.argv[3:]):
        spec = importlib.util.spec_from_file_location(f"program_{i}", Path(d) / "program_jax.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        prog = mod.PROGRAM
        handle = jp.load_model(prog.model)
        host_params = jax.tree.map(np.asarray, handle.init_params(prog.seed))
        host_batch = jp.make_batch(handle, prog.global_batch, prog.seq_len, prog.seed)
        t0 = time.perf_counter()
        losses, params, grads, fidelity = jax_train.train(prog, handle, host_params, host_batch, steps)
        name = Path(d).name
        key = (prog.model, prog.global_batch, prog.seq_len)
        if key not in refs:
            refs[key] = name
            ref_losses, ref_params, ref_grads = jax_train.reference(prog, handle, host_params, host_batch, steps)
            (out / f"{name}_reference.json").write_text(json.dumps({"losses": ref_losses}))
            np.savez(out / f"{name}_reference_grads.npz", **ref_grads)
            np.savez(out / f"{name}_reference_params.npz", **ref_params)
        result = {
            "losses": losses,
            "reference": refs[key],
            "time_s": time.perf_counter() - t0,
            "hlo_collectives": jax_train.hlo_detail(fidelity),
            **jax_train.fidelity_report(prog, fidelity),
        }
        (out / f"{name}.json").write_text(json.dumps(result))
        np.savez(out / f"{name}_grads.npz", **{f: jp.to_host(x) for f, x in grads.items()})
        np.savez(out / f"{name}_params.npz", **{f: jp.to_host(x) for f, x in params.items()})


if __name__ == "__main__":
    main()
