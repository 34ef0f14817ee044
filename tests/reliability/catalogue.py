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

Setup = Callable[[Path, "Fixtures"], None]


@dataclasses.dataclass(frozen=True)
class Fixtures:
    """Compiled plans the plan and launch cases copy and corrupt (built once per session)."""

    plan4: Path  # mlp, 4xCPU, global batch 64 (as the search lays it out)
    plan2: Path  # mlp, 2xCPU, global batch 64 (dp=2)
    gpu_plan: Path  # mlp, 1xA100-80G


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
        ("max restarts 'abc'", "--max-restarts N"),
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
