"""The fp8 program in one process (issue 36 part 2): the emitted set-up converts the stage's linears with
torchao's float8 training under the plan's recipe, and what the program does not build is refused with one
paragraph (exit 2) before anything is traced or written.

torchao is the optional ``[fp8]`` extra and is never importable by the pytest worker (transformers imports
it whenever it can, adding warnings to every trace). ``scripts/install.sh test`` installs it into
``build/fp8-site`` (ignored by git); the fp8 tests hand that directory to their subprocesses only, through
their ``PYTHONPATH`` (:func:`fp8_subprocess_path`): here a child python that runs the program's set-up,
in ``test_fp8_multiprocess.py`` the torchrun ranks of ``partita run`` and the rehearsal's role processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from partita.cli import main

ROOT = Path(__file__).resolve().parents[2]
FP8_SITE = ROOT / "build" / "fp8-site"
FP8_SPEC = "torchao>=0.18,<0.19"  # pyproject's [fp8] extra; scripts/install.sh installs exactly this
INSTALL = f'python -m pip install --no-deps --upgrade --target build/fp8-site "{FP8_SPEC}"'


def fp8_site() -> Path:
    """``build/fp8-site`` holding a torchao in the [fp8] range; a skip naming the install command when the
    directory is missing (an offline install), a failure when it holds another version."""
    if not (FP8_SITE / "torchao").is_dir():
        pytest.skip(
            f"torchao is not installed in {FP8_SITE}: `bash scripts/install.sh test` installs it there "
            f"(it runs `{INSTALL}`; it needs the network or a package index)"
        )
    versions = [p.name.removesuffix(".dist-info").split("-")[1] for p in FP8_SITE.glob("torchao-*.dist-info")]
    assert len(versions) == 1 and versions[0].startswith("0.18."), (
        f"{FP8_SITE} holds torchao {versions}, not {FP8_SPEC}: remove the directory and run `{INSTALL}`"
    )
    return FP8_SITE


@contextlib.contextmanager
def fp8_subprocess_path() -> Iterator[Path]:
    """``build/fp8-site`` appended to ``PYTHONPATH`` for the subprocesses started inside the block (they
    inherit ``os.environ``), never to this process's ``sys.path``; the old value restored after."""
    site = fp8_site()
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([*([old] if old else []), str(site)])
    try:
        yield site
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old


def test_install_script_installs_the_fp8_extras_torchao_range() -> None:
    """The test install puts the very torchao range of pyproject's [fp8] extra into build/fp8-site, which git
    ignores, and the program's own version check (``fp8.TORCHAO_RANGE``) accepts that range."""
    from partita.backends.torch import fp8

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["fp8"] == [FP8_SPEC]
    script = (ROOT / "scripts" / "install.sh").read_text()
    assert INSTALL.removeprefix("python -m pip install ") in script  # the skip reason names that command
    assert "/build/" in (ROOT / ".gitignore").read_text().split()
    lo, hi = (tuple(int(x) for x in v.split(".")) for v in re.findall(r"[<>]=?(\d+\.\d+)", FP8_SPEC))
    assert fp8.TORCHAO_RANGE == (lo, hi)


_CHILD = """
import json, runpy, sys, types
import torch
from torchao.float8.float8_linear import Float8Linear
from partita.backends.torch import materialize
from partita.models.zoo import resolve_model

program, spec = sys.argv[1], sys.argv[2]
ns = runpy.run_path(program, run_name="fp8_program")  # the program as torchrun would import it
model = materialize.materialize(resolve_model(spec), 0).model
linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
rt = types.SimpleNamespace(device=torch.device("cpu"), fsdp_modules=[])
module = ns["setup_stage_0"](model, rt)
f8 = {n: m for n, m in module.named_modules() if isinstance(m, Float8Linear)}
grains = sorted({m.config.cast_config_input.scaling_granularity.value for m in f8.values()})
print("FP8_CHILD " + json.dumps({"linears": linears, "converted": sorted(f8), "granularity": grains}))
"""


@pytest.mark.slow  # traces the tiny Llama here, imports torchao in a child python: ~40 s on the shared 2-core machine
def test_emitted_setup_converts_every_linear_with_the_plans_recipe(tmp_path: Path) -> None:
    fp8_site()  # the skip naming the install command comes before the trace
    from partita.backends.torch.emit import emit_torch
    from partita.cluster import parse_shorthand
    from partita.driver import trace_model
    from partita.models import families
    from partita.plan import Plan
    from partita.search.entry.hand_plan import hand_plan
    from partita.search.pricing.config import TrainingConfig

    spec = str(families.write_config(tmp_path / "llama", families.tiny("llama")) / "config.json")
    tr = TrainingConfig(global_batch=2, seq_len=16, fp8="rowwise")
    graph = trace_model(spec, seq=16).graph
    plan = Plan.from_json(hand_plan(graph, parse_shorthand("1xCPU"), tr, tp=1, pp=1, dp=1, micro_batch=2).to_json())
    src = emit_torch(plan, spec)
    assert "config=Float8LinearConfig.from_recipe_name('rowwise')" in src
    assert "'fp8': 'rowwise'" in src  # PROGRAM["stages"][0]
    program = tmp_path / "program_torch.py"
    program.write_text(src)
    with fp8_subprocess_path():
        cmd = [sys.executable, "-c", _CHILD, str(program), spec]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("FP8_CHILD ")]
    assert proc.returncode == 0 and lines, (proc.stdout + proc.stderr)[-3000:]
    got = json.loads(lines[-1].removeprefix("FP8_CHILD "))
    assert got["linears"] and got["converted"] == sorted(got["linears"])  # the tiny Llama's sizes: multiples of 16
    assert got["granularity"] == ["axiswise"]  # rowwise: one scale per row
    assert "torchao" not in sys.modules  # this process never imported it


def test_program_refuses_in_one_paragraph_without_torchao(monkeypatch: pytest.MonkeyPatch) -> None:
    from partita.backends.torch import fp8
    from partita.errors import ConfigError

    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao -> ImportError
    with pytest.raises(ConfigError) as err:
        fp8.torchao_float8()
    assert "partita[fp8]" in str(err.value) and "--precision bf16" in str(err.value)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["evaluate", "llama-7b", "--cluster", "8xA100-80G", "--tp", "1", "--dp", "8"], "no FP8 tensor cores"),
        (["compile", "mlp", "--cluster", "2xCPU", "--tp", "2"], "--tp 2"),
        (["compile", "jax-mlp", "--cluster", "2xCPU", "--dp", "2"], "the JAX program has no FP8 training"),
    ],
)
def test_fp8_refusals_exit_2_before_writing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], says: str
) -> None:
    out = tmp_path / "out"
    extra = ["--out", str(out)] if args[0] == "compile" else ["--micro-batch", "1"]
    assert main([*args, "--global-batch", "8", "--seq", "16", "--precision", "fp8", *extra]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err
    assert not out.exists() or not any(out.iterdir())
