"""Property-based fuzzing of the whole CLI (issue 34): random option values (empty, blank, negative,
huge, non-numeric, unicode, paths under /proc) and random cluster files through ``partita.cli.main``
in-process. Every command is one that must be refused (an unknown model, a cluster file of random
content, a plan file of random content), so the property is the catalogue's: exit code 2, one
``partita: error:`` paragraph (or argparse's usage line), no traceback, nothing written. Bounded to a
few seconds: ``PARTITA_FUZZ_CLI`` examples per test (default 40, derandomized)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import traceback
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from partita.cli import main

N = int(os.environ.get("PARTITA_FUZZ_CLI", "40"))
SETTINGS = settings(
    max_examples=N,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

values = st.one_of(
    st.sampled_from(["", " ", "0", "-1", "-0", "1e9", "nan", "inf", "10" * 12, "2,", ",", "2,x", "/proc/x", "é"]),
    st.integers(-(10**22), 10**22).map(str),
    st.text(max_size=6),
)
NUMERIC = ["--global-batch", "--seq", "--gpus-per-node", "--tp", "--pp", "--dp", "--micro-batch", "--virtual-stages"]
OTHER = ["--cluster", "--out", "--dtype", "--optimizer", "--zero", "--recompute", "--schedule"]


def _run(argv: list[str], cwd: Path) -> tuple[int | str, str]:
    out, err = io.StringIO(), io.StringIO()
    saved = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc: int | str = main(argv)
            except SystemExit as e:  # argparse's usage errors: exit 2, its one line
                rc = e.code if isinstance(e.code, int) else 1
            except BaseException:  # noqa: BLE001 - a crash: the property fails with it
                traceback.print_exc(file=err)
                rc = "crash"
    finally:
        os.chdir(saved)
    return rc, out.getvalue() + err.getvalue()


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _check(rc: int | str, text: str) -> None:
    assert "Traceback" not in text, text[-2000:]
    assert rc == 2, (rc, text[-2000:])
    assert "error:" in text, text[-2000:]


@SETTINGS
@given(
    command=st.sampled_from(["compile", "evaluate", "trace"]),
    opts=st.lists(st.tuples(st.sampled_from(NUMERIC + OTHER), values), max_size=5),
)
def test_cli_options_never_crash(tmp_path_factory, command: str, opts: list[tuple[str, str]]) -> None:
    t = tmp_path_factory.mktemp("fuzz")
    argv = [command, "zz-no-such-model"]
    for flag, v in opts:
        if command == "trace" and flag not in ("--seq",):
            flag = "--batch" if flag in NUMERIC else "--task"
        argv += [f"{flag}={v}"]  # `--flag=-1`: the value reaches the option, not argparse's flag parser
    if command == "evaluate" and not any(a.startswith("--cluster=") for a in argv):
        argv += ["--cluster", "4xCPU", "--global-batch", "8", "--seq", "4"]
    os.environ["PARTITA_CACHE_DIR"] = str(t / "cache")
    before = _files(t)
    rc, text = _run(argv, t)
    _check(rc, text)
    assert _files(t) == before


yaml_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(10**13), 10**13), st.floats(), st.text(max_size=8)),
    lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(st.text(max_size=10), c, max_size=3)),
    max_leaves=10,
)
node = st.fixed_dictionaries(
    {"device": st.one_of(st.sampled_from(["A100-80G", "CPU", "X", "a100", ""]), yaml_values)},
    optional={
        "num_nodes": yaml_values,
        "gpus_per_node": yaml_values,
        "num_node": yaml_values,
        "network": yaml_values,
        "profile": yaml_values,
    },
)
cluster_docs = st.fixed_dictionaries(
    {"nodes": st.one_of(st.lists(node, max_size=3), yaml_values)},
    optional={"device_types": yaml_values, "links": yaml_values, "network": yaml_values, "nodse": yaml_values},
)


@SETTINGS
@given(doc=cluster_docs, as_json=st.booleans())
def test_cluster_files_never_crash(tmp_path_factory, doc: dict, as_json: bool) -> None:
    t = tmp_path_factory.mktemp("fuzz")
    path = t / ("c.json" if as_json else "c.yaml")
    path.write_text(json.dumps(doc))  # JSON is YAML too
    os.environ["PARTITA_CACHE_DIR"] = str(t / "cache")
    before = _files(t)
    rc, text = _run(["compile", "zz-no-such-model", "--cluster", str(path), "--out", str(t / "out")], t)
    _check(rc, text)
    assert _files(t) == before


@SETTINGS
@given(
    path=st.lists(st.sampled_from(["stages", 0, "tp", "dp", "device_type", "ranks", "training", "global_batch"]),
                  min_size=1, max_size=3),
    value=yaml_values,
)  # fmt: skip
def test_plan_files_never_crash(tmp_path_factory, path: list, value: object) -> None:
    """A compiled plan with one field replaced by a random value: read by ``report``, refused or read."""
    t = tmp_path_factory.mktemp("fuzz")
    src = _plan_fixture(tmp_path_factory)
    shutil.copytree(src, t / "plan")
    d = json.loads((t / "plan" / "plan.json").read_text())
    node, ok = d, True
    for key in path[:-1]:
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            ok = False
            break
    if ok and isinstance(node, (dict, list)):
        try:
            node[path[-1]] = value
        except (IndexError, TypeError):
            pass
    (t / "plan" / "plan.json").write_text(json.dumps(d))
    before = _files(t)
    rc, text = _run(["report", str(t / "plan")], t)
    assert "Traceback" not in text, text[-2000:]
    assert rc in (0, 2), (rc, text[-2000:])
    assert _files(t) == before


_PLAN: list[Path] = []


def _plan_fixture(factory) -> Path:
    if not _PLAN:
        root = factory.mktemp("fuzz-plan")
        os.environ["PARTITA_CACHE_DIR"] = str(root / "cache")
        argv = ["compile", "mlp", "--cluster", "4xCPU", "--global-batch", "64", "--seq", "32", "--dtype", "f32"]
        rc, text = _run([*argv, "--out", str(root / "plan")], root)
        assert rc == 0, text
        _PLAN.append(root / "plan")
    return _PLAN[0]
