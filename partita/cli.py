"""The ``partita`` command: trace, models, clusters, compile, evaluate, run, report.

Top of the flow: parses arguments, calls ``driver.py`` and prints. Every
:class:`~partita.errors.PartitaError` becomes one paragraph on stderr and exit code 2; ``--json``
output is a stable object on stdout (documented in the README). Framework imports are lazy so
``partita models`` and ``partita clusters`` start fast.
"""

from __future__ import annotations

import os
import signal
import sys

_INTERRUPTED = "partita: interrupted (Ctrl-C); files already written are complete, nothing was half-written."
_TERMINATED = "partita: terminated (SIGTERM); files already written are complete, nothing was half-written."


def _interrupted_early(signum: int, frame: object) -> None:
    """Ctrl-C / SIGTERM while the command is still importing, before :func:`main` takes over: nothing is
    written yet, so the command ends at once with its one line (not an import's traceback)."""
    os.write(2, ((_TERMINATED if signum == signal.SIGTERM else _INTERRUPTED) + "\n").encode())
    os._exit(143 if signum == signal.SIGTERM else 130)


if __name__ == "__main__" or os.path.basename(sys.argv[0] if sys.argv else "") == "partita":  # the command
    signal.signal(signal.SIGINT, _interrupted_early)
    signal.signal(signal.SIGTERM, _interrupted_early)

import argparse  # noqa: E402
import json  # noqa: E402
import textwrap  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

from partita.cli_checks import LIMITS, TIME_BUDGET_S, _check_arguments, _internal_error, _paragraph  # noqa: E402, F401
from partita.errors import ConfigError, InternalError, PartitaError  # noqa: E402
from partita.outputs import _check_cache_dir, _check_out_dir, _check_writable_target, os_error_text  # noqa: E402
from partita.progress import wanted as _progress_wanted  # noqa: E402

DEFAULT_MODEL = "gpt3-6.7b"
DEFAULT_CLUSTER = "mixed-lab"


def _print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=1, sort_keys=True) + "\n")


def _fmt_num(x: float) -> str:
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:.0f}"


# ---- commands ------------------------------------------------------------------------------
def cmd_models(args: argparse.Namespace) -> int:
    from partita.models.catalog import FIELDS, load_catalog

    shipped = load_catalog()  # names and sizes without building a model (models/catalog.py)
    if shipped is None:
        from partita.models import list_models

        shipped = [{f: getattr(m, f) for f in FIELDS} for m in list_models()]
    infos = [argparse.Namespace(**m) for m in shipped]
    if args.json:
        _print_json(
            [
                {"name": m.name, "framework": m.framework, "num_params": m.num_params, "description": m.description}
                for m in infos
            ]
        )
        return 0
    width = max(len(m.name) for m in infos)
    for m in infos:
        print(f"{m.name:<{width}}  {m.framework:<5}  {_fmt_num(m.num_params):>8} params  {m.description}")
    return 0


def cmd_clusters(args: argparse.Namespace) -> int:
    from partita.cluster import CLUSTER_PRESETS, DEVICE_PRESETS, parse_cluster

    if args.json:
        _print_json(
            {
                "device_types": {
                    k: {
                        "peak_flops": dict(d.peak_flops),
                        "memory_bytes": d.memory_bytes,
                        "hbm_bandwidth": d.hbm_bandwidth,
                        "intra_node_bandwidth": d.intra_node_bandwidth,
                        "kind": d.kind,
                    }
                    for k, d in DEVICE_PRESETS.items()
                },
                "clusters": {k: v for k, v in CLUSTER_PRESETS.items()},
            }
        )
        return 0
    print("Device types (dense peak per device):")
    for d in DEVICE_PRESETS.values():
        half = d.flops("bf16")
        print(
            f"  {d.name:<9} {half / 1e12:7.1f} TFLOP/s bf16  {d.memory_bytes / 1e9:6.1f} GB  "
            f"{d.hbm_bandwidth / 1e9:7.0f} GB/s HBM  {d.intra_node_bandwidth / 1e9:5.0f} GB/s intra-node"
        )
    print("Cluster presets (or write COUNTxTYPE+COUNTxTYPE, or a YAML/JSON file):")
    for k, v in CLUSTER_PRESETS.items():
        print(f"  {k:<10} {v:<32} {parse_cluster(k).describe()}")
    return 0


def _with_task(model: str, task: str | None) -> str:
    """``--task`` rides on the spec (``DIR#masked-lm``) so the generated program resolves the same model."""
    if not task:
        return model
    from partita.hf_config_check import config_file

    if config_file(model) is None:
        raise ConfigError(
            f"--task {task} picks the head of a Hugging Face config.json, but {model!r} is not one (a zoo model or "
            "a factory has its own head).",
            "drop --task, or pass the config.json (or its directory) as the model.",
        )
    return f"{model}#{task}"


def _add_task(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--task",
        default=None,
        choices=["causal-lm", "masked-lm", "seq2seq-lm", "image-classification"],
        help="the head to train when a config.json's model_type has several (default: its architectures)",
    )


def cmd_trace(args: argparse.Namespace) -> int:
    from partita.driver import trace_model

    traced = trace_model(_with_task(args.model, args.task), batch=args.batch, seq=args.seq)
    summary = traced.summary(batch=args.batch, seq=args.seq)
    if args.json:
        _print_json(summary)
    else:
        from partita.report import trace_text
        from partita.report.trace_kinds import kind_labels

        print(trace_text(summary, kind_labels(traced.graph)), end="")
    return 0


def _training(args: argparse.Namespace) -> Any:
    from partita.search.pricing.config import TrainingConfig

    dtype = {"fp16": "f16", "fp32": "f32"}.get(args.dtype, args.dtype)  # --precision spells them fp16 / fp32
    fp8 = args.fp8_recipe if dtype == "fp8" else None  # fp8: bf16 training with FP8 linears (search/pricing/fp8.py)
    return TrainingConfig(
        global_batch=args.global_batch,
        seq_len=args.seq,
        dtype="bf16" if fp8 else dtype,
        fp8=fp8,
        optimizer=args.optimizer,
    )


def cmd_compile(args: argparse.Namespace) -> int:
    from partita.driver import compile_to_dir

    model = _with_task(args.model or DEFAULT_MODEL, args.task)
    cluster = args.cluster or DEFAULT_CLUSTER
    _check_writable_target(args.out, "--out", want_dir=True)
    _check_out_dir(args.out, args.force)
    layout = _hand_layout(args)
    if layout is not None:
        from partita.driver import compile_layout

        result = compile_layout(
            model, cluster, _training(args), args.out, layout=layout, gpus_per_node=args.gpus_per_node
        )
        if args.json:
            _print_json(result.summary())
        else:
            print(result.as_text())
        return 0
    from partita.driver import cache_dir
    from partita.gc_freeze import frozen_heap

    _check_cache_dir(cache_dir())
    # the collector off the imports and the model (partita/gc_freeze.py); left frozen only by the command itself
    with frozen_heap(process_ends=_MAIN_PID == [os.getpid()]):
        result = compile_to_dir(
            model,
            cluster,
            _training(args),
            args.out,
            force=args.force,
            gpus_per_node=args.gpus_per_node,
            progress=_progress_wanted(args.json),
        )
    if args.json:
        _print_json(result.summary())
    else:
        print(result.as_text())
        from partita.driver import cache_dir

        print(f"compile cache: {cache_dir()} (set PARTITA_CACHE_DIR to move it; --force recompiles)")
    return 0


_LAYOUT_FLAGS = ("tp", "pp", "dp", "micro_batch")
_LAYOUT_OPTIONS = ("zero", "recompute", "schedule", "virtual_stages", "cp")


def _degrees(text: str) -> int | tuple[int, ...]:
    """``--tp``: one degree (``2``), or one per pipeline stage (``2,1,1``)."""
    try:
        got = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a degree: pass an integer (--tp 2) or one per stage, comma-separated (--tp 2,1,1)"
        ) from None
    return got[0] if len(got) == 1 else got


def _hand_layout(args: argparse.Namespace) -> dict[str, Any] | None:
    """The hand-made layout of `partita compile --tp/--pp/--dp/--micro-batch`, or None (search)."""
    given = [f for f in _LAYOUT_FLAGS if getattr(args, f) is not None]
    options = [f for f in _LAYOUT_OPTIONS if getattr(args, f) is not None]
    options += ["sequence-parallel"] if args.sequence_parallel else []
    if not given:
        if options:
            flags = ", ".join("--" + f for f in options)
            raise ConfigError(
                f"{flags} choose part of a hand-made layout, but no layout was given (--tp, --pp, --dp, --micro-batch).",
                f"add the layout's degrees (missing ones default to 1), or drop {flags} to let the search choose.",
            )
        return None
    return {
        "tp": args.tp or 1,
        "pp": args.pp or 1,
        "dp": args.dp or 1,
        "micro_batch": args.micro_batch or 1,
        "zero_stage": args.zero or 0,
        "recompute": args.recompute or "none",
        "schedule": args.schedule or "1f1b",
        "sequence_parallel": args.sequence_parallel,
        # model chunks per rank group: interleaved 1F1B's v (2 unless given); the hand plan checks the rest
        "num_virtual": args.virtual_stages or (2 if args.schedule == "interleaved_1f1b" else 1),
        "cp": args.cp or 1,  # context parallelism (backends/torch/context_parallel.py; emit.check_cp)
    }


def cmd_evaluate(args: argparse.Namespace) -> int:
    from partita.driver import evaluate_model

    ev = evaluate_model(
        args.model,
        args.cluster,
        _training(args),
        tp=args.tp,
        pp=args.pp,
        dp=args.dp,
        micro_batch=args.micro_batch,
        zero_stage=args.zero,
        recompute=args.recompute,
        schedule=args.schedule,
        gpus_per_node=args.gpus_per_node,
        num_virtual=args.virtual_stages,
        sequence_parallel=args.sequence_parallel,
        cp=args.cp,
        progress=_progress_wanted(args.json),
    )
    out = ev.to_dict() if hasattr(ev, "to_dict") else dict(vars(ev))
    if args.json:
        _print_json(out)
    else:
        from partita.report import evaluate_text

        print(evaluate_text(out), end="")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from partita.driver import run_plan

    res = run_plan(
        args.dir,
        steps=args.steps if args.steps is not None else _plan_steps(args.dir),
        reference=args.reference,
        dry_run=args.dry_run,
        nnodes=args.nnodes,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        max_restarts=args.max_restarts,
        extra_args=(*_data_args(args), *args.extra),
        hostfile=args.hostfile,
    )
    par = res.get("parity")
    if args.json:
        _print_json(res)
    elif args.dry_run or args.hostfile:
        print(res.get("command_str", res.get("command")))
    elif par and not par["ok"]:  # the worst parameters, nothing else (backends/torch/parity.py)
        from partita.backends.torch.parity import verdict

        print(verdict(par))
    else:
        for i, loss in enumerate(res.get("losses", [])):
            ref = res.get("reference_losses")
            print(f"step {i + 1}: loss {loss:.6f}" + (f"  reference {ref[i]:.6f}" if ref else ""))
        if par:
            print(f"every parameter matches the single-device run ({par['num_compared']} tensors, {par['dtype']})")
    return 1 if par and not par["ok"] else 0


def _plan_steps(plan_dir: str) -> int:
    """`partita run` without --steps: the plan's training steps, or 3."""
    from partita.driver import load_plan

    try:
        return int(load_plan(plan_dir).training.get("steps", 0) or 3)
    except PartitaError:
        return 3  # run_plan reads the plan again and names what is wrong with it


def _data_args(args: argparse.Namespace) -> list[str]:
    """The training data flags of `partita run`, passed on to the program (backends/torch/data.py)."""
    out = ["--data-file", args.data_file, "--data-dtype", args.data_dtype] if args.data_file else []
    return out + (["--data-fn", args.data_fn] if args.data_fn else [])


def cmd_profile(args: argparse.Namespace) -> int:
    from partita.profile.profiler import profile

    _check_writable_target(args.out, "--out", want_dir=False)  # before minutes of measuring
    prof = profile(args.devices, args.nproc, args.out, args.time_budget, progress=not args.no_progress)
    print(f"wrote {args.out} ({prof.get('device', args.devices)})")
    return 0


def cmd_rehearse(args: argparse.Namespace) -> int:
    from partita.driver import rehearse

    progress = None if args.json else (lambda msg: print(msg, file=sys.stderr, flush=True))
    res = rehearse(args.dir, progress=progress)
    if args.json:
        _print_json(res)
    else:
        print(_rehearsal_text(res))
    return 0 if res["match"] else 1


def _rehearsal_text(res: dict[str, Any]) -> str:
    def row(key: str, got: Any, want: Any) -> str:
        g = f"{got['count']} x, {_fmt_bytes(got['bytes'])}" if got else "-"
        w = f"{want['count']} x, {_fmt_bytes(want['bytes'])}" if want else "-"
        return f"    {key:<22} {g:>24} {w:>24}"

    lines = []
    for s in res["stages"]:
        lines.append(
            f"stage {s['index']} (ranks rehearsed {s['ranks_rehearsed']}): {'match' if s['match'] else 'MISMATCH'}"
        )
        lines.append(f"    {'per step':<22} {'rehearsed':>24} {'planned':>24}")
        for key in sorted(set(s["collectives"]) | set(s["planned_collectives"])):
            lines.append(row(key, s["collectives"].get(key), s["planned_collectives"].get(key)))
        pm, got = s["planned_memory_bytes"], s["peak_memory_bytes"]
        lines.append(
            f"    {'peak memory':<22} {_fmt_bytes(got) if got is not None else '-':>24} "
            f"{_fmt_bytes(pm) if pm else '-':>24}"
        )
        pf, gf = s["planned_flops"], s["flops"]
        lines.append(
            f"    {'FLOPs':<22} {(f'{gf:.4g}' if gf is not None else '-'):>24} {(f'{pf:.4g}' if pf else '-'):>24}"
        )
        lines += [f"    ! {m}" for m in s["mismatches"]]
    lines.append(
        "rehearsal: " + ("the program matches the plan" if res["match"] else "the program differs from the plan")
    )
    return "\n".join(lines)


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def cmd_report(args: argparse.Namespace) -> int:
    from partita.driver import report

    if len(args.dirs) > 2:
        raise ConfigError(
            f"report got {len(args.dirs)} plan directories; it explains one plan or compares two.",
            "pass one DIR, or two to compare (run it again for the others).",
        )
    if args.html:
        _check_writable_target(args.html, "--html", want_dir=False)
    print(report(args.dirs, html=args.html, verbose=args.verbose).rstrip("\n"))
    if args.html:
        what = "the comparison of both plans" if len(args.dirs) == 2 else "the plan's page"
        print(f"wrote {args.html} ({what}; open it in a browser)")
    return 0


# ---- parser --------------------------------------------------------------------------------
def _add_training(p: argparse.ArgumentParser, defaults: bool = True) -> None:
    p.add_argument(
        "--global-batch",
        type=int,
        default=64 if defaults else None,
        required=not defaults,
        help="samples per optimizer step",
    )
    p.add_argument("--seq", type=int, default=2048 if defaults else None, required=not defaults, help="sequence length")
    p.add_argument(
        "--dtype",
        "--precision",
        dest="dtype",
        default="bf16",
        choices=["bf16", "f16", "f32", "fp16", "fp32", "fp8"],
        help="fp8: bf16 training whose linear layers run their GEMMs in FP8 through torchao (H100, H200, L4; "
        "a hand layout: every stage, --tp 1; no layout: the search may choose it where faster, tp 1 stages; "
        "`pip install partita[fp8]` where the program runs)",
    )
    p.add_argument(
        "--fp8-recipe",
        default="tensorwise",
        choices=["tensorwise", "rowwise"],
        help="with --precision fp8: torchao's Float8LinearConfig recipe (scales per tensor or per row)",
    )
    p.add_argument("--optimizer", default="adam", choices=["adam", "sgd"])
    p.add_argument("--gpus-per-node", type=int, default=None, help="devices per node for shorthand clusters")
    p.add_argument(
        "--no-calibration",
        action="store_true",
        help="ignore the calibration profiles shipped for some device types (same as PARTITA_CALIBRATION=off)",
    )


_CP_HELP = (
    "context parallelism: the sequence split over cp ranks, keys and values all-gathered for attention "
    "(search/pricing/context_parallel.py); dp*cp*tp*pp devices"
)
_SP_HELP = (
    "Megatron sequence parallelism (compile with a hand-made layout: tp >= 2, 1f1b / gpipe, recompute none or "
    "selective); `evaluate` refuses it (exit 2 with the reason)"
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="partita",
        description="Auto-parallelization compiler for training on homogeneous and mixed GPU clusters.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=textwrap.dedent("""\
            examples:
              partita compile                       # bundled model on the mixed-lab preset
              partita compile gpt3-6.7b --cluster 16xA100-80G+16xV100-32G --global-batch 256 --seq 2048 --out out/
              partita report out/
              partita run out/ --steps 3 --reference --json
            """),
    )
    p.add_argument(
        "--verbose", action="store_true", help="show other libraries' warnings as they come (any command takes it)"
    )
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("models", help="list the model zoo")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_models)

    s = sub.add_parser("clusters", help="list device types and cluster presets")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_clusters)

    s = sub.add_parser("trace", help="trace a model into the IR and summarize it")
    s.add_argument("model", help="zoo name, path to a HF config.json, or package.module:factory")
    _add_task(s)
    s.add_argument("--batch", type=int, default=1)
    s.add_argument("--seq", type=int, default=None)
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_trace)

    s = sub.add_parser("compile", help="search a plan and write DIR/plan.json, the program and the report")
    s.add_argument("model", nargs="?", default=None, help=f"default: {DEFAULT_MODEL}")
    _add_task(s)
    s.add_argument("--cluster", default=None, help=f"shorthand, preset or file (default: {DEFAULT_CLUSTER})")
    _add_training(s)
    s.add_argument("--out", default="out", help="output directory (default: out)")
    s.add_argument(
        "--force",
        action="store_true",
        help="ignore the compile cache; also write into a non-empty --out that is not a plan directory",
    )
    s.add_argument("--json", action="store_true")
    hand = s.add_argument_group(
        "hand-made layout (no search: the program for this Megatron-style layout, priced by the search's model)"
    )
    hand.add_argument(
        "--tp",
        type=_degrees,
        default=None,
        help="tensor-parallel degree (default 1 once a layout is given), or one per stage: 2,1,1 with --pp 3",
    )
    hand.add_argument("--pp", type=int, default=None, help="pipeline stages (blocks split evenly)")
    hand.add_argument("--dp", type=int, default=None, help="data-parallel replicas")
    hand.add_argument("--micro-batch", type=int, default=None, help="samples per micro-batch and replica")
    hand.add_argument("--zero", type=int, default=None, choices=[0, 1, 2, 3])
    hand.add_argument("--recompute", default=None, choices=["none", "selective", "full"])
    hand.add_argument("--schedule", default=None, choices=["gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv"])
    hand.add_argument(
        "--virtual-stages", type=int, default=None, help="model chunks per stage (interleaved_1f1b; default 2)"
    )
    hand.add_argument("--sequence-parallel", action="store_true", help=_SP_HELP)
    hand.add_argument("--cp", type=int, default=None, help=_CP_HELP + "; compile: Llama, tp 1")
    s.set_defaults(fn=cmd_compile)

    s = sub.add_parser("evaluate", help="predict a fixed Megatron-style configuration")
    s.add_argument("model")
    s.add_argument("--cluster", required=True)
    _add_training(s, defaults=False)
    s.add_argument("--tp", type=int, default=1)
    s.add_argument("--pp", type=int, default=1)
    s.add_argument("--dp", type=int, default=1)
    s.add_argument("--micro-batch", type=int, default=1)
    s.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3])
    s.add_argument("--recompute", default="none", choices=["none", "selective", "full"])
    s.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv"])
    s.add_argument("--virtual-stages", type=int, default=1, help="model chunks per stage (interleaved_1f1b)")
    s.add_argument("--sequence-parallel", action="store_true", help=_SP_HELP)
    s.add_argument("--cp", type=int, default=1, help=_CP_HELP)
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_evaluate)

    s = sub.add_parser("run", help="launch a compiled plan with torchrun (or JAX)")
    s.add_argument("dir")
    s.add_argument("--steps", type=int, default=None, help="default: the plan's training steps, or 3")
    s.add_argument("--reference", action="store_true", help="also run the seeded single-device reference")
    s.add_argument("--dry-run", action="store_true", help="print the launch command only")
    s.add_argument("--nnodes", type=int, default=1)
    s.add_argument("--checkpoint-every", type=int, default=0)
    s.add_argument("--resume", action="store_true")
    s.add_argument(
        "--max-restarts",
        type=int,
        default=None,
        help="torchrun restarts after a rank fails; a restart resumes from the run's latest checkpoint",
    )
    s.add_argument(
        "--hostfile",
        default=None,
        help="`HOST device=TYPE [slots=N]` per node: print one torchrun command per node and write DIR/launch.sbatch",
    )
    s.add_argument("--data-file", default=None, help="flat binary of token ids (nanoGPT train.bin), memory-mapped")
    s.add_argument("--data-dtype", default="uint16", choices=["uint16", "uint32"])
    s.add_argument("--data-fn", default=None, help="module:function(step, rows, seq_len) -> (inputs, labels)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_run)

    s = sub.add_parser("profile", help="measure this machine and write a calibration profile")
    s.add_argument("--devices", choices=("cpu", "cuda"), default="cpu")
    s.add_argument("--nproc", type=int, default=4)
    s.add_argument("--out", default="profile.json")
    s.add_argument("--time-budget", type=float, default=240.0, help="upper bound in seconds")
    s.add_argument("--no-progress", action="store_true")
    s.set_defaults(fn=cmd_profile)

    s = sub.add_parser(
        "rehearse",
        help="run the emitted program at full scale on fake tensors and compare it with the plan (exit 1: differs)",
    )
    s.add_argument("dir")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_rehearse)

    s = sub.add_parser("report", help="explain a plan (or compare two)")
    s.add_argument("dirs", nargs="+")
    s.add_argument("--html", default=None, help="write a self-contained HTML report here")
    s.set_defaults(fn=cmd_report)
    return p


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C's KeyboardInterrupt would be: the same unwinding, exit 143."""


_MAIN_PID: list[int] = []  # the command's own process: its forked workers inherit the handler below


def _on_sigterm(signum: int, frame: Any) -> None:
    if _MAIN_PID and os.getpid() != _MAIN_PID[0]:  # a forked worker being ended (Pool.terminate): end quietly
        os._exit(143)
    raise Terminated()


def _end_workers() -> None:
    """End the worker processes this process forked (the search's pools) before it exits: with
    ``os._exit`` no atexit handler would, and a worker would go on computing for a parent that is gone."""
    mp = sys.modules.get("multiprocessing")
    if mp is None:
        return
    for child in mp.active_children():
        try:
            child.kill()
        except OSError:
            pass


def _exit_interrupted(terminated: bool = False) -> None:
    """End the command process now: the one line, exit 130 (143 for SIGTERM), the forked workers ended,
    no teardown of torch & co. (seconds)."""
    _end_workers()
    print(_TERMINATED if terminated else _INTERRUPTED, file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(143 if terminated else 130)


def _stdout_gone() -> int:
    """stdout's reader went away (``partita models --json | head -c1``): end quietly, as ``cat`` does, with
    128 + SIGPIPE; the interpreter's final flush must not print a BrokenPipeError either."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass
    return 141


def _unraisable(hook: Any) -> Any:
    """A Ctrl-C that lands in a finalizer or weakref callback is "ignored" by the interpreter, and the command
    would go on to exit 0; it ends the command instead. Files are written to a temporary name and renamed, so
    ending here leaves nothing half-written."""

    def on_unraisable(info: Any) -> None:
        if isinstance(info.exc_value, KeyboardInterrupt):
            _exit_interrupted(isinstance(info.exc_value, Terminated))
        hook(info)

    return on_unraisable


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; Ctrl-C anywhere ends it with one line and exit code 130."""
    if argv is None:  # the command itself, not an in-process call
        sys.unraisablehook = _unraisable(sys.unraisablehook)
        import signal

        # SIGINT / SIGTERM sent to this process alone (`timeout -s INT`, a job scheduler) end it as Ctrl-C does
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _MAIN_PID[:] = [os.getpid()]
        signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        rc = _main(argv)
        if argv is None:
            sys.stdout.flush()  # a pipe's reader that went away shows here, not in the interpreter's exit
        return rc
    except KeyboardInterrupt as e:
        terminated = isinstance(e, Terminated)
        if argv is None:
            _exit_interrupted(terminated)
        print(_TERMINATED if terminated else _INTERRUPTED, file=sys.stderr)
        return 143 if terminated else 130
    except BrokenPipeError:
        return _stdout_gone() if argv is None else 141


def _main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    verbose = False
    if "--verbose" in argv[: argv.index("--") if "--" in argv else len(argv)]:  # any position, any command
        verbose = True
        argv.remove("--verbose")
    extra: list[str] = []
    if "--" in argv:  # `partita run DIR [options] -- [training program arguments]`
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    for k in range(len(argv) - 2, -1, -1):  # `--cluster -4xA100`: let the cluster parser say what is wrong
        if argv[k] == "--cluster" and argv[k + 1].startswith("-") and not argv[k + 1].startswith("--"):
            argv[k : k + 2] = [f"--cluster={argv[k + 1]}"]
    args = parser.parse_args(argv)
    args.extra = extra
    refusal = _check_arguments(args)
    if refusal is not None:
        print("partita: error: " + _paragraph(str(refusal)), file=sys.stderr)
        return refusal.exit_code
    args.verbose = verbose  # `partita report --verbose`: the search's developer counters too
    saved_calibration = os.environ.get("PARTITA_CALIBRATION")
    if getattr(args, "no_calibration", False):  # this command plans uncalibrated (cluster.calibration_default)
        os.environ["PARTITA_CALIBRATION"] = "off"
    noise = _ThirdPartyNoise(verbose, children=args.command in ("run", "profile"))
    try:
        with noise:
            return int(args.fn(args) or 0)
    except PartitaError as err:
        if verbose and err.detail:  # the user's own traceback (a factory, a data function)
            print(err.detail.rstrip("\n"), file=sys.stderr)
        if isinstance(err, InternalError):
            return _internal_error(err, verbose)
        text = str(err)
        if "\n" not in err.problem:  # one paragraph; a multi-line problem (a rank's log) stays as it is
            text = _paragraph(text)
        print("partita: error: " + text, file=sys.stderr)
        return err.exit_code
    except BrokenPipeError:
        raise  # stdout closed by its reader: main() ends quietly
    except OSError as err:  # the one path for the operating system's refusals: name the path and the fix
        if verbose:
            import traceback

            traceback.print_exc()
        print("partita: error: " + _paragraph(os_error_text(err)), file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001 - a bug: one paragraph that says so, never a traceback (--verbose: it)
        return _internal_error(err, verbose)
    finally:
        noise.summarize()
        if saved_calibration is None:  # one command's --no-calibration must not outlive it (in-process callers)
            os.environ.pop("PARTITA_CALIBRATION", None)
        else:
            os.environ["PARTITA_CALIBRATION"] = saved_calibration


class _ThirdPartyNoise:
    """Warnings and log records from other libraries (transformers' ``loss_type=None``, bos/eos ids,
    torch.export) held back while a command runs, then one line: "N third-party warnings hidden;
    --verbose shows them". Partita's own warnings and every ERROR record pass through at once.
    With ``verbose`` everything passes through as it comes."""

    def __init__(self, verbose: bool, children: bool = False) -> None:
        self.verbose = verbose
        self.children = children and not verbose and "TRANSFORMERS_VERBOSITY" not in os.environ
        self.held: list[str] = []
        self._emit: Any = None
        self._warnings: Any = None
        self.interrupted = False

    def __enter__(self) -> _ThirdPartyNoise:
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.showwarning = self._show_warning
        if self.children:  # ranks are child processes, out of reach of this hook: quiet their transformers
            os.environ["TRANSFORMERS_VERBOSITY"] = "error"
        if not self.verbose:
            import logging

            self._emit = logging.StreamHandler.emit
            held, emit = self.held, self._emit
            last: list[Any] = [None]

            def quiet_emit(handler: logging.StreamHandler, record: logging.LogRecord) -> None:
                if record.name.split(".")[0] == "partita" or record.levelno >= logging.ERROR:
                    emit(handler, record)
                elif record is not last[0]:  # one record reaching several handlers counts once
                    last[0] = record
                    held.append(f"{record.name}: {record.getMessage()}")

            logging.StreamHandler.emit = quiet_emit  # type: ignore[method-assign,assignment]
        return self

    def __exit__(self, *exc: Any) -> None:
        self.interrupted = exc[0] is KeyboardInterrupt  # Ctrl-C ends with its one line, no summary
        if self.children:
            os.environ.pop("TRANSFORMERS_VERBOSITY", None)
        if self._emit is not None:
            import logging

            logging.StreamHandler.emit = self._emit  # type: ignore[method-assign]
            self._emit = None
        self._warnings.__exit__(*exc)

    def _show_warning(
        self, message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None,
        line: Any = None,
    ) -> None:  # fmt: skip
        text = str(message)
        if text.startswith("partita: "):
            print("partita: warning: " + text[len("partita: ") :], file=sys.stderr)
        elif self.verbose:
            print(warnings.formatwarning(text, category, filename, lineno).rstrip(), file=sys.stderr)
        else:
            self.held.append(f"{category.__name__}: {text}")

    def summarize(self) -> None:
        if self.held and not self.verbose and not self.interrupted:
            sys.stdout.flush()  # a block-buffered stdout (file, pipe) would otherwise split a line around it
            n = len(self.held)
            print(f"partita: {n} third-party warning{'s' if n != 1 else ''} hidden; --verbose shows them",
                  file=sys.stderr)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
