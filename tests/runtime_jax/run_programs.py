"""Run several generated JAX programs in one process (tests only: saves a JAX start-up per plan).

``python run_programs.py STEPS OUT_DIR PLAN_DIR...`` imports each ``PLAN_DIR/program_jax.py``, runs its
``train`` and, once per model, its single-device ``reference``; writes ``OUT_DIR/<name>.json`` (losses,
HLO collectives) and ``OUT_DIR/<name>_{params,grads}.npz``. The parent sets JAX_NUM_CPU_DEVICES.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

from partita.runtime import jax_parallel as jp


def main() -> None:
    steps, out = int(sys.argv[1]), Path(sys.argv[2])
    refs: set[str] = set()
    for i, d in enumerate(sys.argv[3:]):
        spec = importlib.util.spec_from_file_location(f"program_{i}", Path(d) / "program_jax.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        handle = jp.load_model(mod.MODEL)
        host_params = jax.tree.map(np.asarray, handle.init_params(mod.SEED))
        host_batch = jp.make_batch(handle, mod.GLOBAL_BATCH, mod.SEQ_LEN, mod.SEED)
        t0 = time.perf_counter()
        losses, params, grads, hlo, _ = mod.train(handle, host_params, host_batch, steps)
        name = Path(d).name
        result = {"losses": losses, "hlo_collectives": hlo, "time_s": time.perf_counter() - t0}
        (out / f"{name}.json").write_text(json.dumps(result))
        np.savez(out / f"{name}_grads.npz", **{f: jp.to_host(x) for f, x in grads.items()})
        np.savez(out / f"{name}_params.npz", **{f: jp.to_host(x) for f, x in params.items()})
        if mod.MODEL not in refs:
            refs.add(mod.MODEL)
            ref_losses, ref_params, ref_grads = mod.reference(handle, host_params, host_batch, steps)
            (out / f"{mod.MODEL}_reference.json").write_text(json.dumps({"losses": ref_losses}))
            np.savez(out / f"{mod.MODEL}_reference_grads.npz", **ref_grads)
            np.savez(out / f"{mod.MODEL}_reference_params.npz", **ref_params)


if __name__ == "__main__":
    main()
