"""The fp8 program in one process (issue 36 part 2): the emitted set-up converts the stage's linears with
torchao's float8 training under the plan's recipe, and what the program does not build is refused with one
paragraph (exit 2) before anything is traced or written."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from partita.cli import main


@pytest.mark.slow  # traces the tiny Llama and imports torchao: ~30 s on the shared 2-core machine
def test_emitted_setup_converts_every_linear_with_the_plans_recipe(tmp_path: Path) -> None:
    pytest.importorskip("torchao", reason="torchao is the optional [fp8] extra")
    import torch
    from torchao.float8.float8_linear import Float8Linear

    from partita.backends.torch import materialize
    from partita.backends.torch.emit import emit_torch
    from partita.cluster import parse_shorthand
    from partita.driver import trace_model
    from partita.models import families
    from partita.models.zoo import resolve_model
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
    ns: dict[str, object] = {"__name__": "fp8_program", "__file__": str(tmp_path / "program_torch.py")}
    exec(compile(src, "program_torch.py", "exec"), ns)  # noqa: S102  (the program as torchrun would import it)
    model = materialize.materialize(resolve_model(spec), 0).model
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    rt = types.SimpleNamespace(device=torch.device("cpu"), fsdp_modules=[])
    module = ns["setup_stage_0"](model, rt)  # type: ignore[operator]
    converted = [n for n, m in module.named_modules() if isinstance(m, Float8Linear)]
    assert linears and len(converted) == len(linears)  # the tiny Llama's sizes are all multiples of 16
    assert all(
        m.config.cast_config_input.scaling_granularity.value == "axiswise"
        for m in module.modules()
        if isinstance(m, Float8Linear)
    )  # rowwise: one scale per row


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
