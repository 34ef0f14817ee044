"""CLI front door: listing commands, and bad input -> one paragraph, exit code 2, no traceback."""

import json
import subprocess
import sys

import pytest

from partita.cli import main


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "partita.cli", *args], capture_output=True, text=True, timeout=300)


def test_clusters_json(capsys) -> None:
    assert main(["clusters", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "A100-80G" in out["device_types"] and "mixed-lab" in out["clusters"]


def test_clusters_text(capsys) -> None:
    assert main(["clusters"]) == 0
    assert "V100-32G" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, match",
    [
        (
            ["evaluate", "gpt2", "--cluster", "8xB200", "--global-batch", "8", "--seq", "128"],
            "unknown device type 'B200'",
        ),
        (["compile", "gpt2", "--cluster", "8xA100", "--global-batch", "0", "--out", "x"], "--global-batch is 0"),
        (["run", "/nonexistent/dir"], "no plan at"),
    ],
)
def test_bad_input_exit_2(argv: list[str], match: str, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err and err.startswith("partita: error:")


def test_bad_cluster_file_subprocess(tmp_path) -> None:
    bad = tmp_path / "c.yaml"
    bad.write_text("nodes: [ {device: A100")
    r = run_cli("compile", "mlp", "--cluster", str(bad), "--out", str(tmp_path / "o"))
    assert r.returncode == 2, r.stderr
    err = " ".join(r.stderr.split())
    assert "not valid YAML" in err and "line " in err and "Traceback" not in err


@pytest.mark.parametrize(
    "model, match",
    [
        ("gpt-17", "unknown model 'gpt-17'"),
        ("tests.model_fixtures:branchy", "Branchy"),
        ("no.such.module:factory", "cannot load model factory"),
    ],
)
def test_bad_model_subprocess(model: str, match: str) -> None:
    r = run_cli("trace", model)
    assert r.returncode == 2, r.stderr[-3000:]
    err = " ".join(r.stderr.split())
    assert match in err and "Traceback" not in err and "partita: error:" in err
