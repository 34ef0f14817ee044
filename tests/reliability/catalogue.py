"""The bad-input catalogue: every way we know to hand Partita a wrong model, cluster, training
config, plan file or launch, with what the refusal must say.

Each :class:`Case` is one command line (``partita ...``, or the generated program for launch
cases) with the files it needs; ``test_bad_input_catalogue.py`` runs them all and
``python -m tests.reliability.catalogue`` prints the table of ``docs/reliability.md``.
``before`` records what the case did before the reliability work: "" (already a clear error),
"crash" (a traceback) or a note on a misleading or missing message.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

Setup = Callable[[Path, "Fixtures"], None]


@dataclasses.dataclass(frozen=True)
class Fixtures:
    """Compiled plans the plan and launch cases copy and corrupt (built once per session)."""

    plan4: Path  # mlp, 4xCPU, global batch 64 (as the search lays it out)
    plan2: Path  # mlp, 2xCPU, global batch 64 (dp=2)
    gpu_plan: Path  # mlp, 1xA100-80G
    plan_pp2: Path  # gpt2-tiny, 4xCPU, a hand layout of two pipeline stages (pp=2, dp=2)


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    area: str  # model | cluster | training | plan | launch
    what: str  # the bad input, in words
    argv: tuple[str, ...]  # "{t}" is the case's directory, "{plan}" its copy of a compiled plan
    expect: tuple[str, ...]  # substrings of the message: the input it names and the fix
    setup: Setup | None = None
    before: str = ""
    runner: str = "cli"  # cli (in-process main) | subprocess (python -m partita.cli) | program (torchrun-less)
    env: tuple[tuple[str, str], ...] = ()
    xfail: str = ""  # the fix lives in a module this work does not own: what it needs
    importable: bool = False  # the case's directory is on sys.path (its usr_*.py modules)


def _write(name: str, text: str | bytes) -> Setup:
    def setup(t: Path, fx: Fixtures) -> None:
        p = t / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(text if isinstance(text, bytes) else text.encode())

    return setup


def _mkdir(name: str) -> Setup:
    return lambda t, fx: (t / name).mkdir(parents=True)


def _plan(which: str = "plan4", edit: Callable[[Path], None] | None = None) -> Setup:
    """Copy a compiled plan to ``{t}/plan`` and apply ``edit`` to the copy."""

    def setup(t: Path, fx: Fixtures) -> None:
        import shutil

        shutil.copytree(getattr(fx, which), t / "plan")
        if edit is not None:
            edit(t / "plan")

    return setup


def _edit_json(fn: Callable[[dict], None]) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        data = json.loads((d / "plan.json").read_text())
        fn(data)
        (d / "plan.json").write_text(json.dumps(data))

    return edit


def _truncate(d: Path) -> None:
    text = (d / "plan.json").read_text()
    (d / "plan.json").write_text(text[: len(text) // 2])


def _foreign_plan(d: Path) -> None:
    import shutil

    shutil.copy(d.parent / "plan2.json", d / "plan.json")


def _with_plan2(t: Path, fx: Fixtures) -> None:
    import shutil

    shutil.copy(fx.plan2 / "plan.json", t / "plan2.json")
    _plan("plan4", _foreign_plan)(t, fx)


def _compile(cluster: str, model: str = "mlp", *extra: str) -> tuple[str, ...]:
    base = ("compile", model, "--cluster", cluster, "--global-batch", "8", "--seq", "4", "--dtype", "f32")
    return (*base, *extra, "--out", "{t}/out")


def _yaml(name: str, text: str) -> tuple[Setup, tuple[str, ...]]:
    return _write(name, text), _compile("{t}/" + name)


_C = {
    "yaml_syntax": _yaml("c.yaml", "nodes: [ {device: A100"),
    "json_syntax": _yaml("c.json", '{"nodes": ['),
    "empty": _yaml("e.yaml", ""),
    "unknown_field": _yaml("c.yaml", "nodse: [{device: A100-80G}]\n"),
    "no_nodes": _yaml("c.yaml", "name: lab\n"),
    "no_device": _yaml("c.yaml", "nodes: [{num_nodes: 1}]\n"),
    "neg_nic": _yaml("c.yaml", "network: {nic_gbps: -5}\nnodes: [{device: A100-80G}]\n"),
    "zero_link": _yaml("c.yaml", "nodes: [{device: A100-80G, intra_node_GBps: 0}]\n"),
    "zero_nodes": _yaml("c.yaml", "nodes: [{device: A100-80G, num_nodes: 0}]\n"),
    "frac_nodes": _yaml("c.yaml", "nodes: [{device: A100-80G, num_nodes: 1.5}]\n"),
    "str_nodes": _yaml("c.yaml", "nodes: [{device: A100-80G, num_nodes: two}]\n"),
    "nan": _yaml("c.yaml", "nodes: [{device: A100-80G, num_nodes: .nan}]\n"),
    "no_peak": _yaml("c.yaml", "nodes: [{device: X}]\ndevice_types: [{name: X, memory_GB: 8, hbm_GBps: 100}]\n"),
    "zero_mem": _yaml(
        "c.yaml",
        "nodes: [{device: X}]\ndevice_types: [{name: X, peak_tflops: {bf16: 10}, memory_GB: 0, hbm_GBps: 1}]\n",
    ),
    "bad_kind": _yaml(
        "c.yaml",
        "nodes: [{device: X}]\ndevice_types: [{name: X, peak_tflops: {bf16: 10}, memory_GB: 8, hbm_GBps: 100, "
        "kind: tpu}]\n",
    ),
    "unknown_dev": _yaml("c.yaml", "nodes: [{device: Z100, num_nodes: 1}]\n"),
    "bad_profile": _yaml("c.yaml", "nodes: [{device: CPU, gpus_per_node: 2, profile: p.json}]\n"),
}
_LARGE = "nodes: [{device: X, gpus_per_node: 1}]\n"
_LARGE += "device_types: [{name: X, peak_tflops: {bf16: 100}, memory_GB: 0.5, hbm_GBps: 1000}]\n"


def _setups(*fns: Setup) -> Setup:
    def setup(t: Path, fx: Fixtures) -> None:
        for f in fns:
            f(t, fx)

    return setup


CASES: list[Case] = [
    # ---- model ----------------------------------------------------------------------------------
    Case("unknown-model", "model", "unknown zoo name", ("trace", "gpt-17"), ("'gpt-17'", "use a zoo name")),
    Case("near-miss-model", "model", "misspelt zoo name", ("trace", "gpt2-tinny"), ("did you mean", "gpt2-tiny")),
    Case(
        "no-module",
        "model",
        "factory module does not exist",
        ("trace", "no.such.module:factory"),
        ("'no.such.module:factory'", "check the module path"),
    ),
    Case(
        "no-factory",
        "model",
        "factory function does not exist",
        ("trace", "tests.reliability.models:nope"),
        ("models:nope", "check the module path"),
    ),
    Case(
        "not-a-model",
        "model",
        "factory returns neither a module nor (module, inputs)",
        ("trace", "tests.reliability.models:not_a_model"),
        ("not_a_model", "return (module, example_inputs_fn)"),
    ),
    Case(
        "factory-raises",
        "model",
        "the user's factory raises",
        ("trace", "tests.reliability.models:raises"),
        ("models:raises", "ValueError"),
        before="crash",
    ),
    Case(
        "control-flow",
        "model",
        "data-dependent Python control flow (if x.sum() > 0)",
        ("trace", "tests.model_fixtures:branchy"),
        ("Branchy", "model_fixtures.py:14", "remove Python control flow"),
        before="clear, but buried under ~40 lines of torch.export's partial FX graph on stderr",
        runner="subprocess",
    ),
    Case(
        "mask-index",
        "model",
        "dynamic shape with no bound: boolean-mask indexing y[y > 0]",
        _compile("4xCPU", "tests.reliability.models:masked"),
        ("'index'", "models.py", "depends on tensor values", "torch.where"),
        before="misleading: 'no plan fits in memory'",
    ),
    Case(
        "nonzero",
        "model",
        "dynamic shape with no bound: rows picked by nonzero",
        _compile("4xCPU", "tests.reliability.models:nonzero"),
        ("'nonzero'", "depends on tensor values", "fixed-size ops"),
        before="misleading: 'no plan fits in memory'",
    ),
    Case(
        "wrong-inputs",
        "model",
        "example inputs do not match forward()",
        ("trace", "tests.reliability.models:wrong_inputs"),
        ("unexpected keyword argument 'y'", "example_inputs"),
        before="misleading fix (blamed control flow)",
    ),
    Case(
        "seq-too-long",
        "model",
        "--seq longer than the model's positions",
        _compile("4xCPU", "gpt2-tiny")[:6] + ("--seq", "64", "--dtype", "f32", "--out", "{t}/out"),
        ("sequence length 64", "32 positions", "--seq 32"),
        before="silent: compiled a plan the model cannot run",
    ),
    Case(
        "config-bad-json",
        "model",
        "HF config.json is not JSON",
        ("trace", "{t}/config.json"),
        ("config.json", "pass a readable HF config.json"),
        setup=_write("config.json", "{not json"),
    ),
    Case(
        "config-unknown-type",
        "model",
        "HF config.json of an unsupported model_type",
        ("trace", "{t}/config.json"),
        ("'t5x'", "did you mean t5", "fix model_type"),
        setup=_write("config.json", '{"model_type": "t5x"}'),
    ),
    Case(
        "config-missing",
        "model",
        "HF config.json path does not exist",
        ("trace", "{t}/missing.json"),
        ("missing.json", "pass a readable HF config.json"),
    ),
    # ---- cluster --------------------------------------------------------------------------------
    Case("unknown-device", "cluster", "unknown device type", _compile("8xB200"), ("'B200'", "use one of")),
    Case("zero-count", "cluster", "zero devices", _compile("0xA100"), ("device count 0", "COUNT >= 1")),
    Case(
        "negative-count",
        "cluster",
        "negative device count",
        _compile("-4xA100"),
        ("'-4xA100'", "COUNTxTYPE terms"),
        before="unclear: argparse's 'argument --cluster: expected one argument'",
    ),
    Case("swapped-term", "cluster", "TYPExCOUNT instead of COUNTxTYPE", _compile("A100x8"), ("'A100x8'", "COUNTxTYPE")),
    Case(
        "uneven-nodes",
        "cluster",
        "count does not split into nodes",
        _compile("12xA100-80G"),
        ("12 x A100-80G", "--gpus-per-node"),
    ),
    Case(
        "zero-per-node",
        "cluster",
        "--gpus-per-node 0",
        _compile("8xA100", "mlp", "--gpus-per-node", "0"),
        ("--gpus-per-node is 0", "N >= 1"),
    ),
    Case(
        "yaml-syntax",
        "cluster",
        "YAML syntax error",
        _C["yaml_syntax"][1],
        ("c.yaml", "not valid YAML", "line 1", "fix the syntax"),
        setup=_C["yaml_syntax"][0],
        runner="subprocess",
    ),
    Case(
        "json-syntax",
        "cluster",
        "JSON syntax error",
        _C["json_syntax"][1],
        ("c.json", "not valid JSON", "fix the syntax"),
        setup=_C["json_syntax"][0],
    ),
    Case(
        "missing-file",
        "cluster",
        "cluster file does not exist",
        _compile("{t}/missing.yaml"),
        ("missing.yaml", "check"),
    ),
    Case(
        "dir-as-file",
        "cluster",
        "cluster path is a directory",
        _compile("{t}/d.yaml"),
        ("d.yaml", "cannot be read", "readable YAML or JSON"),
        setup=_mkdir("d.yaml"),
        before="crash (IsADirectoryError)",
    ),
    Case(
        "binary-file",
        "cluster",
        "cluster file is binary",
        _compile("{t}/b.yaml"),
        ("b.yaml", "not UTF-8", "readable YAML or JSON"),
        setup=_write("b.yaml", b"\xff\xfe\x00\x80garbage"),
        before="crash (UnicodeDecodeError)",
    ),
    Case("empty-file", "cluster", "empty YAML", _C["empty"][1], ("e.yaml", "must be a mapping"), setup=_C["empty"][0]),
    Case(
        "unknown-field",
        "cluster",
        "misspelt top-level field",
        _C["unknown_field"][1],
        ("'nodse'", "allowed: name, network, nodes"),
        setup=_C["unknown_field"][0],
    ),
    Case(
        "no-nodes", "cluster", "no nodes list", _C["no_nodes"][1], ("no 'nodes' list", "add nodes"), _C["no_nodes"][0]
    ),
    Case(
        "no-device",
        "cluster",
        "node without a device",
        _C["no_device"][1],
        ("nodes[0] needs a 'device'", "device: A100-80G"),
        _C["no_device"][0],
    ),
    Case(
        "negative-bandwidth",
        "cluster",
        "negative NIC bandwidth",
        _C["neg_nic"][1],
        ("'nic_gbps' is -5", "positive"),
        _C["neg_nic"][0],
    ),
    Case(
        "zero-bandwidth",
        "cluster",
        "zero intra-node bandwidth",
        _C["zero_link"][1],
        ("'intra_node_GBps' is 0", "positive"),
        _C["zero_link"][0],
    ),
    Case(
        "zero-nodes",
        "cluster",
        "num_nodes: 0",
        _C["zero_nodes"][1],
        ("'num_nodes' is 0", "positive"),
        _C["zero_nodes"][0],
    ),
    Case(
        "fractional-nodes",
        "cluster",
        "num_nodes: 1.5",
        _C["frac_nodes"][1],
        ("must be integers", "whole numbers"),
        _C["frac_nodes"][0],
    ),
    Case(
        "string-count",
        "cluster",
        "num_nodes: two",
        _C["str_nodes"][1],
        ("'num_nodes' is 'two'", "set num_nodes to a number"),
        _C["str_nodes"][0],
    ),
    Case("nan-count", "cluster", "num_nodes: .nan", _C["nan"][1], ("is nan", "finite number"), _C["nan"][0]),
    Case(
        "no-peak",
        "cluster",
        "custom device type without peak_tflops",
        _C["no_peak"][1],
        ("device_types[0]", "'peak_tflops'", "bf16: 312"),
        _C["no_peak"][0],
    ),
    Case(
        "zero-memory",
        "cluster",
        "custom device type with memory_GB: 0",
        _C["zero_mem"][1],
        ("'memory_GB' is 0", "positive"),
        _C["zero_mem"][0],
    ),
    Case(
        "bad-kind",
        "cluster",
        "custom device kind: tpu",
        _C["bad_kind"][1],
        ("kind 'tpu'", "gpu, cpu"),
        _C["bad_kind"][0],
        before="silent: accepted; the runtime would pick nccl for it",
    ),
    Case(
        "unknown-device-file",
        "cluster",
        "unknown device type in a file",
        _C["unknown_dev"][1],
        ("'Z100'", "device_types"),
        _C["unknown_dev"][0],
    ),
    Case(
        "missing-profile",
        "cluster",
        "calibration profile path does not exist",
        _C["bad_profile"][1],
        ("p.json", "does not exist", "partita profile"),
        _C["bad_profile"][0],
        before="misleading: 'no plan fits in memory' (search/pipeline/stage_cost.py swallows the ProfileError)",
    ),
    Case(
        "malformed-profile",
        "cluster",
        "calibration profile of the wrong format",
        _C["bad_profile"][1],
        ("p.json", "not a Partita efficiency profile", "format="),
        _setups(_C["bad_profile"][0], _write("p.json", '{"format": "something-else"}')),
        before="misleading: 'no plan fits in memory'",
    ),
    Case(
        "does-not-fit",
        "cluster",
        "model does not fit the devices (1.1 GB of state, 0.5 GB devices)",
        _compile("{t}/c.yaml", "tests.reliability.models:wide")[:-2] + ("--dtype", "bf16", "--out", "{t}/out"),
        ("no plan fits in memory", "has 500.0 MB", "add devices"),
        _write("c.yaml", _LARGE),
    ),
    # ---- training config ------------------------------------------------------------------------
    Case(
        "zero-batch",
        "training",
        "--global-batch 0",
        _compile("4xCPU")[:4] + ("--global-batch", "0", "--out", "{t}/out"),
        ("--global-batch is 0", "N >= 1"),
    ),
    Case(
        "negative-seq",
        "training",
        "--seq -1",
        _compile("4xCPU")[:4] + ("--seq", "-1", "--out", "{t}/out"),
        ("--seq is -1", "N >= 1"),
    ),
    Case(
        "bad-dtype",
        "training",
        "--dtype f64",
        _compile("4xCPU")[:4] + ("--dtype", "f64", "--out", "{t}/out"),
        ("--dtype", "'f64'", "choose from"),
    ),
    Case(
        "bad-optimizer",
        "training",
        "--optimizer lion",
        _compile("4xCPU")[:4] + ("--optimizer", "lion", "--out", "{t}/out"),
        ("--optimizer", "'lion'", "choose from"),
    ),
    Case(
        "batch-not-divisible",
        "training",
        "global batch not divisible by micro-batch x dp",
        ("evaluate", "mlp", "--cluster", "4xCPU", "--global-batch", "10", "--seq", "4", "--dp", "4"),
        ("global batch 10", "micro_batch*dp=4", "divide the batch"),
    ),
    Case(
        "too-many-degrees",
        "training",
        "dp x tp x pp larger than the cluster",
        ("evaluate", "mlp", "--cluster", "4xCPU", "--global-batch", "16", "--seq", "4", "--tp", "8"),
        ("dp*tp*pp = 8", "4 devices", "larger cluster"),
    ),
    Case(
        "tp-per-stage-count",
        "training",
        "--tp with one degree per stage, but not as many as --pp stages",
        ("compile", "gpt2-tiny", "--cluster", "4xCPU", "--global-batch", "8", "--seq", "16", "--tp", "2,1")
        + ("--pp", "3", "--out", "{t}/out"),
        ("2 tensor-parallel degrees (2,1) for pp=3", "one degree for every stage"),
        before="new option",
    ),
    Case(
        "sequence-parallel-tp1",
        "training",
        "--sequence-parallel on a layout without tensor parallelism",
        ("compile", "llama-tiny", "--cluster", "4xCPU", "--global-batch", "8", "--seq", "16", "--tp", "1")
        + ("--dp", "4", "--sequence-parallel", "--out", "{t}/out"),
        ("sequence parallelism cannot be built here", "tp=1", "--tp 2 or more"),
        before="new option",
    ),
    Case(
        "zero-micro-batch",
        "training",
        "--micro-batch 0",
        ("evaluate", "mlp", "--cluster", "4xCPU", "--global-batch", "16", "--seq", "4", "--micro-batch", "0"),
        ("--micro-batch is 0", "N >= 1"),
    ),
    Case(
        "out-is-file",
        "training",
        "--out names an existing file",
        _compile("4xCPU"),
        ("--out", "is a file, not a directory", "pass a directory"),
        setup=_write("out", "not a directory"),
        before="crash (FileExistsError) after tracing and searching",
    ),
    # ---- plan file ------------------------------------------------------------------------------
    Case("no-plan", "plan", "run a directory with no plan", ("run", "{t}/nowhere"), ("nowhere", "partita compile")),
    Case(
        "truncated-plan",
        "plan",
        "truncated plan.json",
        ("run", "{t}/plan", "--steps", "1"),
        ("plan.json", "not valid JSON", "truncated", "recompile"),
        _plan(edit=_truncate),
        runner="subprocess",
    ),
    Case(
        "empty-plan",
        "plan",
        "empty plan.json",
        ("run", "{t}/plan"),
        ("plan.json", "not valid JSON", "recompile"),
        _plan(edit=lambda d: (d / "plan.json").write_text("")),
    ),
    Case(
        "binary-plan",
        "plan",
        "plan.json overwritten with binary garbage",
        ("run", "{t}/plan"),
        ("plan.json", "not UTF-8", "recompile"),
        _plan(edit=lambda d: (d / "plan.json").write_bytes(b"\x89PNG\r\n\x1a\n\xff\x00")),
        before="crash (UnicodeDecodeError)",
    ),
    Case(
        "not-a-plan",
        "plan",
        "JSON that is not a plan",
        ("run", "{t}/plan"),
        ("is not a Partita plan", "pass the plan.json written by `partita compile`"),
        _plan(edit=lambda d: (d / "plan.json").write_text("[1, 2, 3]")),
    ),
    Case(
        "other-version",
        "plan",
        "plan from another Partita version (format version 2)",
        ("run", "{t}/plan"),
        ("plan version 2", "reads version 1", "recompile the plan with this Partita version"),
        _plan(edit=_edit_json(lambda d: d.update(version=2))),
    ),
    Case(
        "missing-field",
        "plan",
        "plan without 'stages'",
        ("report", "{t}/plan"),
        ("missing or has a malformed field", "'stages'", "do not edit plan.json by hand"),
        _plan(edit=_edit_json(lambda d: d.pop("stages"))),
    ),
    Case(
        "duplicate-rank",
        "plan",
        "a rank listed twice in a stage",
        ("run", "{t}/plan"),
        ("ranks [1] more than once", "each rank is in one stage"),
        _plan(edit=_edit_json(lambda d: d["stages"][0].update(ranks=[0, 1, 1, 2]))),
        before="silent: accepted; rank 3 would crash at launch (in no stage)",
    ),
    Case(
        "rank-gap",
        "plan",
        "stage ranks with a gap (0, 1, 2, 5)",
        ("run", "{t}/plan"),
        ("ranks [0, 1, 2, 5] are not 0..3", "recompile"),
        _plan(edit=_edit_json(lambda d: d["stages"][0].update(ranks=[0, 1, 2, 5]))),
    ),
    Case(
        "unknown-schedule",
        "plan",
        "unknown pipeline schedule",
        ("run", "{t}/plan"),
        ("schedule 'zigzag' is unknown", "use one of"),
        _plan(edit=_edit_json(lambda d: d.update(schedule="zigzag"))),
    ),
    Case(
        "batch-mismatch",
        "plan",
        "global batch the plan's micro-batches do not cover (80 vs 1 x 4 x 16)",
        ("run", "{t}/plan"),
        ("= 64 per step", "global_batch is 80", "recompile the plan"),
        _plan(edit=_edit_json(lambda d: d["training"].update(global_batch=80))),
        before="silent: the runtime would train on 64 of every 80 samples",
    ),
    Case(
        "bad-shares",
        "plan",
        "batch shares that do not sum to the micro-batch",
        ("run", "{t}/plan"),
        ("batch_shares [16, 16, 16]", "entries summing to 64", "recompile"),
        _plan(edit=_edit_json(lambda d: d["stages"][0].update(batch_shares=[16, 16, 16]))),
    ),
    Case(
        "no-program",
        "plan",
        "program_torch.py missing",
        ("run", "{t}/plan"),
        ("no PyTorch program", "recompile"),
        _plan(edit=lambda d: (d / "program_torch.py").unlink()),
    ),
    Case(
        "foreign-program",
        "plan",
        "plan.json of another compile beside the program (2 vs 4 ranks)",
        ("run", "{t}/plan"),
        ("was not generated from the plan.json beside it", "recompile"),
        _with_plan2,
        before="misleading: launched 2 ranks, which refused with 'needs 4 ranks'",
    ),
    # ---- launch inputs of issue 17 (hostfile, token file) ----------------------------------------
    Case(
        "hostfile-short",
        "launch",
        "a hostfile whose node has fewer slots than the plan puts there (2 vs 4)",
        ("run", "{t}/plan", "--dry-run", "--hostfile", "{t}/hosts"),
        ("slots=2", "4 ranks", "slots=4 or more"),
        lambda t, fx: (_plan()(t, fx), _write("hosts", "node01 device=CPU slots=2\n")(t, fx)),
        before="no hostfile placement: one --nproc-per-node for every node",
    ),
    Case(
        "hostfile-wrong-type",
        "launch",
        "a hostfile whose only node has another device type than the plan",
        ("run", "{t}/plan", "--dry-run", "--hostfile", "{t}/hosts"),
        ("A100-80G", "does not have", "as the cluster spec names it"),
        lambda t, fx: (_plan()(t, fx), _write("hosts", "node01 device=A100-80G slots=8\n")(t, fx)),
    ),
    Case(
        "token-file-short",
        "launch",
        "a token file shorter than one global batch",
        ("run", "{t}/plan", "--data-file", "{t}/train.bin"),
        ("holds 16 tokens", "fewer than one global batch", "longer file"),
        lambda t, fx: (_plan()(t, fx), _write("train.bin", bytes(32))(t, fx)),
    ),
    Case(
        "token-file-dtype",
        "launch",
        "a token file whose size is not a multiple of its declared dtype (uint32)",
        ("run", "{t}/plan", "--data-file", "{t}/train.bin", "--data-dtype", "uint32"),
        ("not a multiple of 4", "--data-dtype"),
        lambda t, fx: (_plan()(t, fx), _write("train.bin", bytes(4 * 64 + 2))(t, fx)),
    ),
    Case(
        "report-corrupt",
        "plan",
        "report on a truncated plan",
        ("report", "{t}/plan"),
        ("plan.json", "not valid JSON"),
        _plan(edit=_truncate),
    ),
    Case(
        "html-missing-dir",
        "plan",
        "report --html into a directory that does not exist",
        ("report", "{t}/plan", "--html", "{t}/no/such/dir/plan.html"),
        ("--html", "does not exist", "create it"),
        _plan(),
        before="crash (FileNotFoundError)",
    ),
    # ---- launch ---------------------------------------------------------------------------------
    Case(
        "wrong-world-size",
        "launch",
        "program launched with 2 ranks for a 4-rank plan",
        ("{t}/plan/program_torch.py", "--steps", "1"),
        ("needs 4 ranks", "WORLD_SIZE=2", "--nproc-per-node 4"),
        _plan(),
        before="clear, but as a traceback from every rank",
        runner="program",
        env=(("WORLD_SIZE", "2"), ("RANK", "0"), ("LOCAL_RANK", "0")),
    ),
    Case(
        "gpu-plan-on-cpu",
        "launch",
        "plan compiled for A100s run on a machine without CUDA",
        ("run", "{t}/plan", "--steps", "1"),
        ("compiled for GPUs", "torch.cuda is not available", "4xCPU"),
        _plan("gpu_plan"),
        before="clear, but only after torchrun started every rank",
    ),
    Case(
        "zero-nodes-launch",
        "launch",
        "--nnodes 0",
        ("run", "{t}/plan", "--dry-run", "--nnodes", "0"),
        ("--nnodes is 0", "N >= 1"),
        _plan(),
        before="crash (ZeroDivisionError)",
    ),
    Case(
        "uneven-nodes-launch",
        "launch",
        "4 ranks over 3 nodes",
        ("run", "{t}/plan", "--dry-run", "--nnodes", "3"),
        ("4 ranks do not split over 3 nodes", "divides 4"),
        _plan(),
    ),
    Case(
        "multi-node-run",
        "launch",
        "--nnodes 2 without --dry-run",
        ("run", "{t}/plan", "--nnodes", "2"),
        ("launches on this machine only", "--dry-run"),
        _plan(),
    ),
    Case(
        "zero-steps",
        "launch",
        "--steps 0",
        ("run", "{t}/plan", "--steps", "0"),
        ("--steps is 0", "N >= 1"),
        _plan(),
    ),
    Case(
        "negative-restarts",
        "launch",
        "--max-restarts -1",
        ("run", "{t}/plan", "--max-restarts", "-1"),
        ("--max-restarts is -1", "N >= 0"),
        _plan(),
        before="new option",
    ),
    Case(
        "bad-restarts-env",
        "launch",
        "PARTITA_MAX_RESTARTS=abc",
        ("run", "{t}/plan", "--dry-run"),
        ("PARTITA_MAX_RESTARTS='abc'", "--max-restarts N"),
        _plan(),
        before="new option",
        env=(("PARTITA_MAX_RESTARTS", "abc"),),
    ),
    Case(
        "negative-checkpoint-every",
        "launch",
        "--checkpoint-every -1",
        ("run", "{t}/plan", "--checkpoint-every", "-1"),
        ("--checkpoint-every is -1", "N >= 0"),
        _plan(),
        before="silent: accepted (saved after every step)",
    ),
]


# ---- issue 34: 117 bad inputs of a skeptical user, by class -----------------------------------------
def _truncate_program(d: Path) -> None:
    """Cut program_torch.py inside its plan literal (as a full disk would leave it)."""
    text = (d / "program_torch.py").read_text()
    (d / "program_torch.py").write_text(text[: text.index("'training'")])


def _run(*extra: str) -> tuple[str, ...]:
    return ("run", "{t}/plan", *extra)


def _yaml_case(cid: str, what: str, text: str, expect: tuple[str, ...], before: str) -> Case:
    setup, argv = _yaml("c.yaml", text)
    return Case(cid, "cluster", what, argv, expect, setup, before=before)


def _plan_case(cid: str, what: str, fn: Callable[[dict], None], expect: tuple[str, ...], before: str) -> Case:
    return Case(cid, "plan", what, ("report", "{t}/plan"), expect, _plan(edit=_edit_json(fn)), before=before)


def _bound(cid: str, what: str, argv: tuple[str, ...], expect: tuple[str, ...], before: str, **kw: Any) -> Case:
    return Case(cid, "bounds", what, argv, expect, before=before, **kw)


_USR_SYNTAX = _write("usr_syntax.py", "def factory(:\n    pass\n")
_USR_IMPORT = _write("usr_import_raises.py", "raise RuntimeError('no GPU on this machine')\n")
_M = "tests.reliability.models:"
_EV = ("evaluate", "mlp", "--cluster", "4xCPU", "--global-batch", "16", "--seq", "4")
_TYPE = "{name: X, peak_tflops: {bf16: 10}, memory_GB: 8, hbm_GBps: 100}"
_HUGE = "100000000000000000000"

NEW_CASES: list[Case] = [
    # ---- no upper bounds -------------------------------------------------------------------------
    _bound("huge-device-count", "a device count of 10^8", _compile("100000000xA100-80G"),
           ("100,000,000 devices", "1,048,576", "smaller cluster"), "slow: SystemError / MemoryError after a minute"),
    _bound("huge-node-count-file", "num_nodes: 10^12 in a cluster file", _C["nan"][1],
           ("8,000,000,000,000 devices", "smaller cluster"), "slow: MemoryError",
           setup=_write("c.yaml", "nodes: [{device: A100-80G, num_nodes: 1000000000000}]\n")),
    _bound("huge-global-batch", "--global-batch 10^20", _compile("4xCPU")[:4] + ("--global-batch", _HUGE),
           ("--global-batch is " + _HUGE, "N <= 16777216"), "crash (OverflowError / SystemError)"),
    _bound("huge-seq", "--seq 10^9", _compile("4xCPU")[:4] + ("--seq", "1000000000", "--out", "{t}/out"),
           ("--seq is 1000000000", "N <= 4194304"), "slow: MemoryError"),
    _bound("huge-trace-batch", "trace --batch 10^12", ("trace", "mlp", "--batch", "1000000000000"),
           ("--batch is 1000000000000", "N <= 65536"), "accepted"),
    _bound("huge-tp", "evaluate --tp 10^5", (*_EV, "--tp", "100000"), ("--tp is 100000", "N <= 1024"),
           "misleading: 'exceeds the cluster'"),
    _bound("huge-dp", "evaluate --dp 10^9", (*_EV, "--dp", "1000000000"), ("--dp is 1000000000", "N <= 1048576"),
           "misleading: 'exceeds the cluster'"),
    _bound("huge-micro-batch", "evaluate --micro-batch 10^9", (*_EV, "--micro-batch", "1000000000"),
           ("--micro-batch is 1000000000", "N <= 16777216"), "misleading"),
    _bound("huge-pp", "compile --pp 10^5", _compile("4xCPU", "mlp", "--pp", "100000"),
           ("--pp is 100000", "N <= 4096"), "misleading"),
    _bound("huge-tp-per-stage", "compile --tp 2,100000 --pp 2", _compile("4xCPU", "mlp", "--tp", "2,100000", "--pp", "2"),
           ("--tp is 100000", "N <= 1024"), "misleading"),
    _bound("huge-gpus-per-node", "--gpus-per-node 10^5", _compile("8xA100", "mlp", "--gpus-per-node", "100000"),
           ("--gpus-per-node is 100000", "N <= 1024"), "misleading: 'does not split into nodes'"),
    _bound("huge-virtual-stages", "--virtual-stages 1000", _compile("4xCPU", "mlp", "--pp", "2", "--virtual-stages", "1000"),
           ("--virtual-stages is 1000", "N <= 64"), "misleading"),
    _bound("huge-nproc", "profile --nproc 10^5", ("profile", "--nproc", "100000", "--out", "{t}/p.json"),
           ("--nproc is 100000", "N <= 1024"), "would start 100,000 processes"),
    _bound("nan-time-budget", "profile --time-budget nan", ("profile", "--time-budget", "nan", "--out", "{t}/p.json"),
           ("--time-budget is nan", "finite, positive"), "silent: accepted"),
    _bound("negative-time-budget", "profile --time-budget -5", ("profile", "--time-budget", "-5", "--out", "{t}/p.json"),
           ("--time-budget is -5.0", "finite, positive"), "silent: accepted"),
    _bound("huge-steps", "run --steps 10^12", _run("--steps", "1000000000000"),
           ("--steps is 1000000000000", "N <= 10000000"), "accepted (a run of 10^12 steps)", setup=_plan()),
    _bound("huge-nnodes", "run --dry-run --nnodes 10^9", _run("--dry-run", "--nnodes", "1000000000"),
           ("--nnodes is 1000000000", "N <= 65536"), "misleading", setup=_plan()),
    _bound("huge-checkpoint-every", "run --checkpoint-every 10^12", _run("--checkpoint-every", "1000000000000"),
           ("--checkpoint-every is 1000000000000", "N <= 10000000"), "silent: accepted", setup=_plan()),
    _bound("huge-max-restarts", "run --max-restarts 10^6", _run("--max-restarts", "1000000"),
           ("--max-restarts is 1000000", "N <= 1000"), "silent: accepted", setup=_plan()),
    # ---- factory loading ------------------------------------------------------------------------
    Case("factory-syntax-error", "model", "factory module with a syntax error", ("trace", "usr_syntax:factory"),
         ("'usr_syntax:factory'", "SyntaxError", "usr_syntax.py:1", "--verbose"), _USR_SYNTAX,
         before="crash (SyntaxError traceback)", importable=True),
    Case("factory-syntax-error-compile", "model", "the same, through compile",
         _compile("4xCPU", "usr_syntax:factory"), ("'usr_syntax:factory'", "SyntaxError"), _USR_SYNTAX,
         before="crash (SyntaxError traceback)", importable=True),
    Case("factory-import-raises", "model", "factory module raises at import", ("trace", "usr_import_raises:factory"),
         ("'usr_import_raises:factory'", "RuntimeError: no GPU on this machine", "usr_import_raises.py:1"),
         _USR_IMPORT, before="crash (RuntimeError traceback)", importable=True),
    Case("factory-empty-module", "model", "empty module name (':factory')", ("trace", ":factory"),
         ("':factory'", "package.module:function"), before="crash (ValueError: Empty module name)"),
    Case("factory-empty-function", "model", "empty function name ('module:')", ("trace", _M),
         ("package.module:function", "mymodels:build"), before=""),
    Case("factory-bad-module-name", "model", "module name with a space", ("trace", "my models:build"),
         ("'my models:build'", "package.module:function"), before=""),
    Case("inputs-raise", "model", "the example-inputs function raises", ("trace", _M + "inputs_raise"),
         ("inputs_raise", "KeyError", "models.py", "--verbose"), before="crash (KeyError traceback)"),
    Case("inputs-raise-compile", "model", "the same, through compile", _compile("4xCPU", _M + "inputs_raise"),
         ("inputs_raise", "KeyError"), before="crash (KeyError traceback)"),
    Case("inputs-not-callable", "model", "the example inputs are not a function", ("trace", _M + "inputs_not_callable"),
         ("inputs_not_callable", "not callable", "not a function"), before="crash (TypeError traceback)"),
    Case("factory-sys-exit", "model", "the factory calls sys.exit(3)", ("trace", _M + "exits"),
         ("models:exits", "sys.exit(3)"), before="silent: exit 3, no output"),
    Case("factory-sys-exit-compile", "model", "the same, through compile", _compile("4xCPU", _M + "exits"),
         ("models:exits", "sys.exit(3)"), before="silent: exit 3, no output"),
    # ---- writes (one OS-error path) ----------------------------------------------------------------
    Case("out-under-proc", "writes", "--out under /proc", _compile("4xCPU")[:-1] + ("/proc/partita-out",),
         ("/proc/partita-out", "cannot be written", "this user can write"), before="crash (FileNotFoundError)"),
    Case("out-under-sys", "writes", "--out under /sys (permission denied, even for root)",
         _compile("4xCPU")[:-1] + ("/sys/partita-out",), ("/sys/partita-out", "cannot be written"),
         before="crash (PermissionError)"),
    Case("out-under-file", "writes", "--out below a file", _compile("4xCPU")[:-1] + ("{t}/f/sub",),
         ("is a file, not a directory",), _write("f", "x"), before=""),
    Case("html-is-dir", "writes", "report --html names a directory", ("report", "{t}/plan", "--html", "{t}/d"),
         ("--html", "is a directory", "file name"), _setups(_plan(), _mkdir("d")),
         before="crash (IsADirectoryError), a .tmp file left behind"),
    Case("html-under-proc", "writes", "report --html under /proc", ("report", "{t}/plan", "--html", "/proc/p.html"),
         ("/proc", "cannot be written"), _plan(), before="crash (FileNotFoundError)"),
    Case("html-under-sys", "writes", "report --html under /sys", ("report", "{t}/plan", "--html", "/sys/p.html"),
         ("/sys", "cannot be written"), _plan(), before="crash (PermissionError)"),
    Case("cache-is-file", "writes", "PARTITA_CACHE_DIR is a file", _compile("4xCPU"),
         ("compile cache directory", "is a file", "PARTITA_CACHE_DIR"), _write("cachefile", "x"),
         before="crash (NotADirectoryError) after the search", env=(("PARTITA_CACHE_DIR", "{t}/cachefile"),)),
    Case("cache-under-file", "writes", "PARTITA_CACHE_DIR below a file", _compile("4xCPU"),
         ("compile cache directory", "PARTITA_CACHE_DIR"), _write("cachefile", "x"),
         before="crash (NotADirectoryError) after the search", env=(("PARTITA_CACHE_DIR", "{t}/cachefile/c"),)),
    Case("cache-under-proc", "writes", "PARTITA_CACHE_DIR under /proc", _compile("4xCPU"),
         ("/proc/partita-cache", "PARTITA_CACHE_DIR"), before="crash (FileNotFoundError) after the search",
         env=(("PARTITA_CACHE_DIR", "/proc/partita-cache"),)),
    Case("cache-read-only", "writes", "PARTITA_CACHE_DIR not writable (/sys)", _compile("4xCPU"),
         ("/sys/partita-cache", "writable directory"), before="crash (PermissionError) after the search",
         env=(("PARTITA_CACHE_DIR", "/sys/partita-cache"),)),
    Case("profile-out-under-proc", "writes", "profile --out under /proc", ("profile", "--out", "/proc/p.json"),
         ("/proc", "cannot be written"), before="crash (FileNotFoundError) after minutes of measuring"),
    Case("profile-out-is-dir", "writes", "profile --out names a directory", ("profile", "--out", "{t}/d"),
         ("--out", "is a directory"), _mkdir("d"), before="crash (IsADirectoryError) after minutes of measuring"),
    # ---- --out into a user's directory, empty strings -----------------------------------------------
    Case("out-user-dir", "writes", "--out into a directory holding the user's own report.txt",
         _compile("4xCPU"), ("holding other files (report.txt)", "not a Partita plan directory", "--force"),
         _write("out/report.txt", "my notes"), before="silent: overwrote the user's report.txt"),
    Case("out-user-dir-layout", "writes", "the same with a hand-made layout",
         _compile("4xCPU", "mlp", "--dp", "4"), ("not a Partita plan directory", "--force"),
         _setups(_write("out/notes.md", "x"), _write("out/data/a.bin", b"\0")), before="silent: wrote beside them"),
    Case("empty-out", "cli", "--out ''", _compile("4xCPU")[:-1] + ("",), ("--out is an empty string",),
         before="silent: wrote into the current directory"),
    Case("empty-cluster", "cli", "--cluster ''", _compile(""), ("--cluster is an empty string",),
         before="silent: planned for the bundled mixed-lab cluster"),
    Case("blank-cluster", "cli", "--cluster '  '", _compile("  "), ("--cluster is an empty string",),
         before=""),
    Case("empty-model", "cli", "compile ''", _compile("4xCPU", ""), ("MODEL is an empty string",),
         before="misleading: planned the default model ('no plan fits')"),
    Case("empty-trace-model", "cli", "trace ''", ("trace", ""), ("MODEL is an empty string",), before=""),
    Case("empty-run-dir", "cli", "run ''", ("run", ""), ("DIR is an empty string",), before="misleading: 'no plan at plan.json'"),
    Case("empty-report-dir", "cli", "report ''", ("report", ""), ("DIR is an empty string",), before="misleading: 'no plan at plan.json'"),
    Case("empty-html", "cli", "report --html ''", ("report", "{t}/plan", "--html", ""), ("--html is an empty string",),
         _plan(), before="silent: no page written"),
    Case("empty-hostfile", "cli", "run --hostfile ''", _run("--dry-run", "--hostfile", ""),
         ("--hostfile is an empty string",), _plan(), before="silent: ignored"),
    Case("empty-data-fn", "cli", "run --data-fn ''", _run("--data-fn", ""), ("--data-fn is an empty string",),
         _plan(), before="silent: ignored"),
    Case("empty-data-file", "cli", "run --data-file ''", _run("--data-file", ""), ("--data-file is an empty string",),
         _plan(), before="silent: ignored"),
    Case("empty-profile-out", "cli", "profile --out ''", ("profile", "--out", ""), ("--out is an empty string",),
         before="crash after minutes of measuring"),
    # ---- cluster files ------------------------------------------------------------------------------
    _yaml_case("node-key-typo", "unknown key in a node (num_node)", "nodes: [{device: CPU, num_node: 4}]\n",
               ("'num_node'", "did you mean 'num_nodes'"), "silent: 1 node instead of 4"),
    _yaml_case("node-key-typo-per-node", "unknown key in a node (gpus_per_nod)",
               "nodes: [{device: CPU, gpus_per_nod: 4}]\n", ("'gpus_per_nod'", "did you mean 'gpus_per_node'"),
               "silent: 1 device instead of 4"),
    _yaml_case("type-key-typo", "unknown key in a device type (memory_gb)",
               "nodes: [{device: X}]\ndevice_types: [{name: X, peak_tflops: {bf16: 10}, memory_gb: 8, hbm_GBps: 1}]\n",
               ("'memory_gb'", "did you mean 'memory_GB'"), "misleading: 'missing field memory_GB'"),
    _yaml_case("type-key-typo-latency", "unknown key in a device type (intra_node_latency)",
               "nodes: [{device: X}]\ndevice_types: [{name: X, peak_tflops: {bf16: 10}, memory_GB: 8, hbm_GBps: 1, "
               "intra_node_latency: 3}]\n", ("'intra_node_latency'", "did you mean 'intra_node_latency_us'"),
               "silent: the default latency"),
    _yaml_case("link-key-typo", "unknown key in a link (nic_gbp)",
               "nodes: [{device: A100-80G}, {device: V100-32G}]\nlinks: [{between: [0, 1], nic_gbp: 100}]\n",
               ("'nic_gbp'", "did you mean 'nic_gbps'"), "unclear: no nearest key"),
    _yaml_case("network-key-typo", "unknown key in the network (latency_s)",
               "network: {latency_s: 5}\nnodes: [{device: A100-80G}]\n", ("'latency_s'", "did you mean 'latency_us'"),
               "unclear: no nearest key"),
    _yaml_case("duplicate-type", "two device types with one name",
               f"nodes: [{{device: X}}]\ndevice_types: [{_TYPE}, {_TYPE.replace('10}', '20}')}]\n",
               ("'X' is defined twice", "its own name"), "silent: the last one won"),
    _yaml_case("type-shadows-preset", "a device type named as a preset (A100-80G)",
               "nodes: [{device: A100-80G}]\ndevice_types: [" + _TYPE.replace("name: X", "name: A100-80G") + "]\n",
               ("'A100-80G' has the name of the preset A100-80G", "another name"), "silent: replaced the preset"),
    _yaml_case("type-shadows-preset-case", "a device type named as a preset in other case (cpu)",
               "nodes: [{device: cpu}]\ndevice_types: [" + _TYPE.replace("name: X", "name: cpu") + "]\n",
               ("'cpu' has the name of the preset CPU", "another name"), "silent: replaced the preset"),
    _yaml_case("list-as-device", "a list where a device name belongs", "nodes: [{device: [A100-80G]}]\n",
               ("device is ['A100-80G'], not a name", "one name"), "misleading: unknown device type \"['A100-80G']\""),
    _yaml_case("mapping-as-type-name", "a mapping where a type name belongs",
               "nodes: [{device: X}]\ndevice_types: [" + _TYPE.replace("name: X", "name: {x: 1}") + "]\n",
               ("name is {'x': 1}, not a name",), "misleading"),
    _yaml_case("number-as-device", "a number where a device name belongs", "nodes: [{device: 100}]\n",
               ("device is 100, not a name",), "misleading: unknown device type '100'"),
    # ---- plan files -------------------------------------------------------------------------------
    _plan_case("plan-unknown-device", "a stage on an unknown device type",
               lambda d: d["stages"][0].update(device_type="Z100"),
               ("device type 'Z100'", "does not have (CPU)", "recompile"), "silent: accepted and printed"),
    _plan_case("plan-unknown-replica-device", "a replica on an unknown device type",
               lambda d: d["stages"][0].update(replica_device_types=["CPU", "Z100", "CPU", "CPU"]),
               ("device type 'Z100'",), "silent: accepted"),
    _plan_case("plan-nan", "a NaN in the plan", lambda d: d["predicted"].update(step_time_s=float("nan")),
               ("holds NaN", "recompile"), "silent: printed 'nan'"),
    _plan_case("plan-tp-string", "a malformed field (tp: 'two')", lambda d: d["stages"][0].update(tp="two"),
               ("'stages[0].tp'", "'two' is not an integer"), "unclear: the field not named"),
    _plan_case("plan-missing-dp", "a missing stage field (dp)", lambda d: d["stages"][0].pop("dp"),
               ("'stages[0].dp' (missing)",), "unclear: KeyError: 'dp'"),
    _plan_case("plan-stages-mapping", "stages a mapping, not a list", lambda d: d.update(stages={"0": 1}),
               ("'stages'", "not a list"), "unclear: the field not named"),
    _plan_case("plan-micro-batch-list", "micro_batch_size a list", lambda d: d.update(micro_batch_size=[1]),
               ("'micro_batch_size'", "not an integer"), "unclear: the field not named"),
    _plan_case("plan-fractional-dp", "dp: 1.5", lambda d: d["stages"][0].update(dp=1.5),
               ("'stages[0].dp'", "1.5 is not an integer"), "misleading: 'has dp=1, tp=1 but 4 ranks'"),
    # ---- runs -------------------------------------------------------------------------------------
    Case("resume-no-checkpoint", "launch", "--resume with no checkpoint", _run("--resume"),
         ("--resume", "no checkpoint under", "drop --resume"), _plan(), before="silent: started at step 1"),
    Case("resume-empty-checkpoint-dir", "launch", "--resume with an empty --checkpoint-dir",
         _run("--resume", "--", "--checkpoint-dir", "{t}/ck"), ("no checkpoint under", "ck"),
         _setups(_plan(), _mkdir("ck")), before="silent: started at step 1"),
    Case("truncated-run-log", "launch", "a truncated run log", ("report", "{t}/plan"),
         ("run_log.json", "truncated", "run `partita run"), _setups(_plan(), _write("plan/run_log.json", '{"format": "par')),
         before="silent: left out of the report"),
    Case("binary-run-log", "launch", "a run log of binary garbage", ("report", "{t}/plan"),
         ("run_log.json", "not a whole run log"), _setups(_plan(), _write("plan/run_log.json", b"\xff\xfe\x00")),
         before="silent: left out of the report"),
    Case("data-fn-wrong-signature", "launch", "--data-fn of the wrong signature (step, rows)",
         _run("--data-fn", _M + "data_fn_two_args"), ("data_fn_two_args", "(step, rows, seq_len)"), _plan(),
         before="crash: four ranks' tracebacks"),
    Case("data-fn-not-callable", "launch", "--data-fn naming a number", _run("--data-fn", _M + "data_fn_not_callable"),
         ("data_fn_not_callable", "not a function"), _plan(), before=""),
    Case("data-fn-no-colon", "launch", "--data-fn without a function", _run("--data-fn", "mydata"),
         ("'mydata' is not module:function",), _plan(), before="misleading: 'is not a callable'"),
    Case("data-fn-syntax-error", "launch", "--data-fn module with a syntax error", _run("--data-fn", "usr_syntax:factory"),
         ("--data-fn 'usr_syntax:factory'", "SyntaxError"), _setups(_plan(), _USR_SYNTAX),
         before="misleading: 'No module named usr_syntax'", importable=True),
    Case("truncated-program", "launch", "a truncated program_torch.py", _run(),
         ("program_torch.py is not valid Python", "truncated", "--force"),
         _plan(edit=_truncate_program),
         before="misleading: 'fix the error above' with nothing above"),
    Case("truncated-program-rehearse", "launch", "rehearse a truncated program_torch.py", ("rehearse", "{t}/plan"),
         ("program_torch.py is not valid Python", "--force"),
         _plan(edit=_truncate_program),
         before="misleading: 'not the program this Partita emits'"),
    # ---- context parallelism (issue 36) ----------------------------------------------------------
    Case("cp-not-dividing-seq", "training", "evaluate --cp not dividing the sequence length",
         ("evaluate", "gpt2-tiny", "--cluster", "8xCPU", "--global-batch", "8", "--seq", "30", "--cp", "4"),
         ("cp=4 does not divide the sequence length 30", "use a cp dividing 30"), before="new option"),
    Case("cp-no-sequence", "training", "evaluate --cp on a model traced without a sequence dimension",
         (*_EV, "--cp", "2"), ("without a symbolic sequence length", "--cp 1"), before="new option"),
    _bound("huge-cp", "evaluate --cp 10^5", (*_EV, "--cp", "100000"), ("--cp is 100000", "N <= 1024"), "new option"),
    Case("compile-cp", "training", "compile --cp 2 of a model whose attention the cp program does not set",
         (*_compile("4xCPU", "gpt2-tiny", "--dp", "2", "--cp", "2"),),
         ("is built for LlamaForCausalLM", "compile this model without --cp"), before="new option"),
    Case("compile-cp-pp", "training", "compile --cp 2 --pp 2 --zero 2 (cp in a send/recv pipeline: not emitted)",
         (*_compile("4xCPU", "llama-tiny", "--pp", "2", "--zero", "2", "--cp", "2"),),
         ("in a pipeline that runs on explicit send/recv", "ZeRO-0/1"), before="new option"),
    _plan_case("plan-cp-not-dividing-seq", "a stage's cp not dividing the sequence (cp: 3)",
               lambda d: d["stages"][0].update(cp=3), ("cp=3, which does not divide training.seq_len",), "new option"),
]  # fmt: skip
CASES += NEW_CASES
from tests.reliability.catalogue_review import REVIEW_CASES  # noqa: E402 - its cases use the helpers above

CASES += REVIEW_CASES

# Checked by the slow tests (they need a torchrun launch): listed here for the table.
SLOW_CASES = [
    ("resume-other-run", "launch", "--resume from a checkpoint of another training config", "test_replan.py"),
    (
        "stale-checkpoint-dir",
        "launch",
        "fresh run into a directory holding another run's checkpoints",
        "test_faults.py",
    ),
]


def table(results: dict[str, str]) -> str:
    """The markdown table of docs/reliability.md from ``{case id: message}``."""
    rows = ["| # | case | area | bad input | message (excerpt) | before | status |", "|---|---|---|---|---|---|---|"]
    for k, c in enumerate(CASES, 1):
        text = results.get(c.id, "")
        if "Traceback" in text:  # an open crash: its last line
            msg = "crash: " + text.strip().splitlines()[-1][:100]
        else:
            msg = " ".join(text.split()).split("error: ", 1)[-1][:110]
        msg = msg.replace("|", "\\|")
        status = "open: " + c.xfail.split(":")[0] if c.xfail else ("fixed" if c.before else "clear")
        status = "new" if c.before == "new option" else status
        rows.append(f"| {k} | `{c.id}` | {c.area} | {c.what} | {msg} | {c.before or '-'} | {status} |")
    for k, (cid, area, what, where) in enumerate(SLOW_CASES, len(CASES) + 1):
        rows.append(f"| {k} | `{cid}` | {area} | {what} | (see {where}) | new check | fixed |")
    return "\n".join(rows)


if __name__ == "__main__":  # print the docs table: run every case once
    import sys
    import tempfile

    from tests.reliability.test_bad_input_catalogue import build_fixtures, run_case

    with tempfile.TemporaryDirectory() as tmp:
        fx = build_fixtures(Path(tmp) / "fixtures")
        results = {}
        for c in CASES:
            rc, text = run_case(c, Path(tmp) / c.id, fx)
            results[c.id] = text.replace(str(Path(tmp) / c.id), "{t}")
            print(f"{c.id}: rc={rc}", file=sys.stderr)
    print(table(results))
