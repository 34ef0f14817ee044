"""``@partita.parallelize(...)`` on a JAX loss: 8 CPU devices, losses equal the undecorated function's.

``examples/train_jax.py --reference`` runs in a subprocess with ``JAX_NUM_CPU_DEVICES=8``: a flax MLP
(planned dp=4 x tp=2 at the time of writing) and a tiny flax GPT train 3 steps through
``loss_fn.train_step(optax.adam)``, and the undecorated functions train on one device; losses must
agree (fp32, rtol 1e-5). A second script checks that the decorated loss composes with
``jax.value_and_grad`` inside the user's own ``jax.jit``, that parameters land in the plan's layouts,
and that a second decoration of the same function is a compile-cache hit.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from partita.backends.jax.run import device_env

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_jax.py"

CHECK = """
import json, sys
sys.path.insert(0, "examples")
import jax, jax.numpy as jnp, numpy as np
import partita
import train_jax as ex
from partita.backends.jax.emit import param_specs
from partita.backends.jax import parallel as jp

x = jax.random.normal(jax.random.PRNGKey(1), (64, 64)); y = jnp.tanh(x[:, :32])
params = ex.MLP().init(jax.random.PRNGKey(2), x)
plain = jax.jit(jax.value_and_grad(ex.mlp_loss.__wrapped__))(params, x, y)

@jax.jit
def user_step(p, x, y):
    return jax.value_and_grad(ex.mlp_loss)(p, x, y)  # the decorated loss inside the user's jit

loss, grads = user_step(params, x, y)
plan = ex.mlp_loss.plan
placed = ex.mlp_loss.shard(params)
shapes = {f: v.shape for f, v in jp.flatten(params).items()}
want = {f: s[0] for f, s in param_specs(plan, shapes, dict.fromkeys(shapes, 0)).items()}
got = {f: v.sharding.spec for f, v in jp.flatten(placed).items()}
again = partita.parallelize(ex.mlp_loss.__wrapped__, cluster="8xCPU", global_batch=64, seq_len=1)
again(params, x, y)
print(json.dumps({
    "loss": float(loss), "plain_loss": float(plain[0]),
    "grad_diff": max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(plain[1]))),
    "specs_match": all(got[f] == want[f] for f in want), "sharded": any(len(v.sharding.device_set) == 8 for v in jp.flatten(placed).values()),
    "second_cache_hit": again.cache_hit, "mesh": [plan.stages[0].dp, plan.stages[0].tp],
}))
"""


def _run(args: list[str], cache: Path) -> list[dict]:
    env = device_env(8) | {"PARTITA_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_decorated_training_matches_the_undecorated_function(tmp_path: Path) -> None:
    out = {d["model"]: d for d in _run([str(SCRIPT), "--reference"], tmp_path)}
    assert set(out) == {"mlp", "gpt"}
    for d in out.values():
        assert d["devices"] == 8 and d["cache_hit"] is False
        assert sum(s["ranks"] for s in d["plan"]) == 8  # the plan spans the 8 devices
        assert all(math.isfinite(x) for x in d["losses"]) and d["losses"][-1] < d["losses"][0]
        assert d["losses"] == pytest.approx(d["reference_losses"], rel=1e-5, abs=1e-6)
    check = _run(["-c", CHECK], tmp_path)[0]  # same cache: the example compiled the MLP's plan
    assert check["loss"] == pytest.approx(check["plain_loss"], rel=1e-6)
    assert check["grad_diff"] < 1e-5
    assert check["specs_match"] and check["sharded"]
    assert check["second_cache_hit"] is True
