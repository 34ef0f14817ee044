"""Launch files beside a multi-node program, and model paths every command resolves the same way (issue 33).

* a plan on 8xH100-80G + 16xA100-40G + 8xL4 gets one launch script per device type and a SLURM
  heterogeneous job with one component per type; each script, run with ``PYTHON=echo``, prints the
  torchrun command of its i-th node: the node rank and process count of ``hosts.plan_nodes`` (the
  static rendezvous's order), never one ``--nproc-per-node 28`` for all; the program's header names them;
* ``partita compile`` writes them in the plan directory, and removes them when it compiles a one-node
  plan there;
* a plan on one node gets none, and its header names ``torchrun --nproc-per-node``;
* a relative ``config.json`` path: the program names it absolute, ``partita run`` started from the plan
  directory trains it, and a compile cache entry emitted for another path is not served for this one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from partita.backends.torch import hosts
from partita.backends.torch import launch as torch_launch
from partita.backends.torch.emit import emit_torch
from partita.cli import main as cli_main
from partita.driver import program_model
from partita.models.families import tiny, write_config
from tests.runtime.plans import layout
from tests.runtime.test_gpu_launch import _three_type_plan


def _run_script(path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(path), "--steps", "5"], capture_output=True, text=True, env={**os.environ, "PYTHON": "echo", **env}
    )


def test_multi_node_plan_gets_a_launch_per_device_type_and_a_heterogeneous_sbatch(tmp_path: Path) -> None:
    plan = _three_type_plan()
    files = torch_launch.launch_files(plan)
    assert set(files) == {"launch_h100-80g.sh", "launch_a100-40g.sh", "launch_l4.sh", "launch.sbatch"}
    sbatch = files["launch.sbatch"]
    assert sbatch.count("#SBATCH hetjob") == 2 and sbatch.count("srun --het-group=") == 3
    assert sbatch.index("launch_h100-80g.sh") < sbatch.index("launch_a100-40g.sh") < sbatch.index("launch_l4.sh")
    for name, text in files.items():
        (tmp_path / name).write_text(text)
        assert subprocess.run(["bash", "-n", str(tmp_path / name)]).returncode == 0, name
    nodes = hosts.plan_nodes(plan)  # (device, ranks) per node rank
    for dev, script in (("H100-80G", "launch_h100-80g.sh"), ("A100-40G", "launch_a100-40g.sh"), ("L4", "launch_l4.sh")):
        mine = [(k, ranks) for k, (d, ranks) in enumerate(nodes) if d == dev]
        for i, (k, ranks) in enumerate(mine):
            got = _run_script(tmp_path / script, {"PARTITA_NODE_INDEX": str(i), "MASTER_ADDR": "head"})
            assert got.returncode == 0, got.stderr
            words = got.stdout.split()
            assert words[words.index("--nnodes") + 1] == str(len(nodes))
            assert words[words.index("--node-rank") + 1] == str(k)
            assert words[words.index("--nproc-per-node") + 1] == str(len(ranks))
            assert words[words.index("--master-addr") + 1] == "head" and words[-3:] == [
                "program_torch.py",
                "--steps",
                "5",
            ]
        bad = _run_script(tmp_path / script, {"PARTITA_NODE_INDEX": str(len(mine)), "MASTER_ADDR": "head"})
        assert bad.returncode == 2 and "PARTITA_NODE_INDEX" in bad.stderr
    header = emit_torch(plan, "gpt2-tiny").split('"""')[1]
    assert "sbatch launch.sbatch" in header and "launch_l4.sh" in header and "--nproc-per-node" not in header


@pytest.mark.slow
def test_compile_writes_the_launch_files_beside_a_multi_node_program(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``partita compile`` (not only ``launch_files``): a hand layout on 16xA100-80G (2 nodes) gets its
    launch script and sbatch in the plan directory, as ``launch_files`` writes them for the plan read
    back; compiled again there for one node (``--force``), the old launch files are gone."""
    from partita.plan import read_plan

    monkeypatch.setenv("PARTITA_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "p"
    task = ["--global-batch", "16", "--seq", "16", "--tp", "1", "--pp", "2", "--micro-batch", "1"]
    assert cli_main(["compile", "gpt2-tiny", "--cluster", "16xA100-80G", *task, "--dp", "8", "--out", str(out)]) == 0
    want = torch_launch.launch_files(read_plan(out / "plan.json"))
    assert set(want) == {"launch_a100-80g.sh", "launch.sbatch"}
    assert {n: (out / n).read_text() for n in want} == want
    assert "sbatch launch.sbatch" in (out / "program_torch.py").read_text().split('"""')[1]
    one = ["compile", "gpt2-tiny", "--cluster", "8xA100-80G", *task, "--dp", "4", "--out", str(out), "--force"]
    assert cli_main(one) == 0
    assert not list(out.glob("launch*")), sorted(p.name for p in out.iterdir())


def test_one_node_plan_gets_no_launch_files() -> None:
    plan = layout("gpt2-tiny", "pp_1f1b")
    assert torch_launch.launch_files(plan) == {}
    assert f"torchrun --nproc-per-node {plan.world_size} program_torch.py" in emit_torch(plan, "gpt2-tiny")


@pytest.mark.multiprocess
def test_relative_model_path_runs_from_the_plan_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PARTITA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    write_config(tmp_path / "a", tiny("llama"))
    monkeypatch.chdir(tmp_path)
    task = ["--cluster", "1xCPU", "--global-batch", "2", "--seq", "8"]
    assert cli_main(["compile", "a/config.json", *task, "--out", "plan_a"]) == 0
    program = (tmp_path / "plan_a" / "program_torch.py").read_text()
    assert program_model(program) == str((tmp_path / "a" / "config.json").resolve())
    monkeypatch.chdir(tmp_path / "plan_a")
    assert cli_main(["run", ".", "--steps", "1"]) == 0, capsys.readouterr().err
    # the same content under another path, the first one gone: the cache entry emitted for a/ is not served
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "a")
    assert cli_main(["compile", "b/config.json", *task, "--out", "plan_b"]) == 0
    got = program_model((tmp_path / "plan_b" / "program_torch.py").read_text())
    assert got == str((tmp_path / "b" / "config.json").resolve())


@pytest.mark.slow
def test_a_plan_compiled_from_a_relative_path_rehearses_from_another_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``partita rehearse`` reads the model from the program, where compile wrote it absolute: the plan
    of ``a/config.json`` rehearses from a directory where that relative path names nothing."""
    import json

    monkeypatch.setenv("PARTITA_CACHE_DIR", str(tmp_path / "cache"))
    write_config(tmp_path / "a", tiny("llama"))
    monkeypatch.chdir(tmp_path)
    task = ["--cluster", "1xCPU", "--global-batch", "2", "--seq", "8"]
    assert cli_main(["compile", "a/config.json", *task, "--out", "plan_a"]) == 0
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    capsys.readouterr()
    assert cli_main(["rehearse", "../plan_a", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["match"], [s["mismatches"] for s in res["stages"]]
