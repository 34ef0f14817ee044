"""Per-parameter parity of a parallel run with the seeded single-device run (``partita run --reference``).

Sits beside ``backends/torch/train.py``: the program dumps every parameter's full gradient at step 1
(``--dump-grads DIR --dump-steps 1``) and every full parameter after the last step (``--dump-params
DIR``), one file per pipeline stage (written by the stage's rank at (dp, tp) = (0, 0)), and
``train.reference_run(..., dump_steps=[1], params=True)`` gives the same by FQN on one device.
:func:`compare` checks them name by name under the tolerance of the plan's dtype (:data:`GRAD_TOLERANCE`
for the step-1 gradients, :data:`TOLERANCE` for the parameters, the tables in ``docs/parity.md``; under
Adam the parameters leave out the elements whose step-1 gradient is float noise, :func:`adam_noise`);
:func:`table` prints the worst parameters.

A parameter differs when ``max|got - want| > atol + rtol * max|want|`` (its largest error against the
largest magnitude of the reference tensor, so a tensor of near-zero entries is not judged by
elementwise ratios). A parameter missing on either side, or of another shape, is a difference too.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

# (rtol, atol) per plan dtype, for the parameters after N steps: f32 runs differ from one device only by
# the order of float sums (dp/tp reductions, micro-batch accumulation), but under Adam an element whose
# gradient is that noise around a true zero moves by up to lr per step whatever its sign (docs/parity.md:
# 1e-3 of a tensor's largest entry measured); bf16/f16 compute in low precision (FSDP2 MixedPrecisionPolicy
# or autocast), so they are judged at a few units of their rounding.
# fp8 (issue 36 part 2): a plan training its linears in FP8 (torchao) is compared with the bf16 single-device run:
# E4M3 keeps 3 mantissa bits (unit roundoff U = 2**-4), and the dynamic scales of a micro-batch differ from the
# full batch's, so its gradients and parameters are judged at 4 U (docs/parity.md, "FP8"); a dropped dp
# all-reduce (half the gradient) still fails it.
TOLERANCE: dict[str, tuple[float, float]] = {
    "f32": (1e-2, 1e-5),
    "bf16": (5e-2, 1e-3),
    "f16": (2e-2, 1e-4),
    "fp8": (0.25, 1e-2),
}
# the step-1 gradients, where no optimizer amplifies the noise: f32 is judged at 1e-4 of the largest entry
# (the matrices measure <= 1e-6; a missing tp reduction of DeepSeek-V3's rope key moved them by 1e-3..8e-3)
GRAD_TOLERANCE: dict[str, tuple[float, float]] = {**TOLERANCE, "f32": (1e-4, 1e-7)}


def tolerance(what: str, dtype: str) -> tuple[float, float]:
    """(rtol, atol) of a tensor kind (``"grad@1"`` or ``"param@N"``) under the plan's dtype."""
    table = GRAD_TOLERANCE if what.startswith("grad") else TOLERANCE
    return table.get(dtype, table["f32"])


SHOW_NAMES = 40  # the verdict names this many differing parameters beside the table


@dataclass(frozen=True)
class Row:
    """One parameter's difference: which tensor (``"grad@1"``: the step-1 gradient, ``"param@N"``)."""

    what: str
    name: str
    shape: tuple[int, ...]
    max_abs: float
    rel: float  # max_abs / max|want|
    ok: bool
    note: str = ""


# Under Adam an element whose step-1 gradient is float noise moves by an arbitrary amount (its update is
# lr * g / (|g| + eps): sign and size of the noise). Such elements are left out of the parameters' comparison:
# those whose step-1 gradient is at most NOISE x the model's largest step-1 gradient in both runs and not
# exactly zero in both (attention key biases, whose true gradient is zero, carry 1e-12..1e-10 of it in the
# model matrix; an element zero in one run and 1e-10 in the other moved by 1e-4 after 3 AdamW steps at lr
# 1e-2). Their step-1 gradients are still compared, at the gradient tolerance.
NOISE = 1e-6


def adam_noise(
    training: Mapping[str, object], want: Mapping[str, torch.Tensor], got: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Per parameter, the elements :func:`compare` leaves out of ``param@N`` (comment above), from the
    reference's (``want``) and the parallel run's (``got``) step-1 gradients: none unless the plan trains
    with Adam / AdamW."""
    if str(training.get("optimizer", "adamw")).lower() == "sgd" or not want:
        return {}
    floor = NOISE * max(float(g.detach().abs().max()) if g.numel() else 0.0 for g in want.values())
    out = {}
    for name, w in want.items():
        g = got.get(name)
        if g is None or g.shape != w.shape:
            continue
        a, b = w.detach().abs().cpu(), g.detach().abs().cpu()
        noise = (torch.maximum(a, b) <= floor) & ((a > 0) | (b > 0))
        if bool(noise.any()):
            out[name] = noise
    return out


def compare(
    got: Mapping[str, torch.Tensor],
    want: Mapping[str, torch.Tensor],
    what: str,
    dtype: str = "f32",
    ignore: Mapping[str, torch.Tensor] | None = None,
) -> list[Row]:
    """One :class:`Row` per parameter of ``want`` (and per name only ``got`` has); ``ignore``: per name, the
    elements left out (:func:`adam_noise`), counted in the row's note."""
    rtol, atol = tolerance(what, dtype)
    rows = []
    for name in sorted(set(want) | set(got)):
        w, g = want.get(name), got.get(name)
        if w is None or g is None:
            have = tuple(w.shape if w is not None else g.shape)  # type: ignore[union-attr]
            side = "the parallel run" if g is None else "the single-device run"
            rows.append(Row(what, name, have, float("inf"), float("inf"), False, f"missing in {side}"))
            continue
        if tuple(g.shape) != tuple(w.shape):
            note = f"shape {tuple(g.shape)} in the parallel run"
            rows.append(Row(what, name, tuple(w.shape), float("inf"), float("inf"), False, note))
            continue
        w64, g64 = w.detach().double().cpu(), g.detach().double().cpu()
        skip = (ignore or {}).get(name)
        err = (g64 - w64).abs()
        note = ""
        if skip is not None and skip.shape == err.shape:
            err = err.masked_fill(skip, 0.0)
            note = f"{int(skip.sum())} element(s) with a float-noise step-1 gradient left out"
        diff = float(err.max()) if w64.numel() else 0.0
        scale = float(w64.abs().max()) if w64.numel() else 0.0
        rel = diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))
        rows.append(Row(what, name, tuple(w.shape), diff, rel, diff <= atol + rtol * scale, note))
    return rows


def load_dumps(directory: str, pattern: str) -> dict[str, torch.Tensor]:
    """Every stage's dump in ``directory`` (``grads_step1_rank*.pt``, ``params_rank*.pt``) merged by FQN."""
    out: dict[str, torch.Tensor] = {}
    for path in sorted(glob.glob(os.path.join(directory, pattern))):
        out.update(torch.load(path, map_location="cpu", weights_only=True))
    return out


def worst(rows: Sequence[Row], n: int = 10) -> list[Row]:
    """The failing rows first, the step-1 gradients before the parameters after N steps (a wrong gradient
    is the evidence; every parameter drifts once any gradient differed, the more so under Adam), then by
    relative difference, at most ``n``."""
    return sorted(rows, key=lambda r: (r.ok, not r.what.startswith("grad"), -r.rel, -r.max_abs))[:n]


def table(rows: Sequence[Row], n: int = 10) -> str:
    """The worst parameters as a fixed-width table (name, shape, max abs / relative difference)."""
    top = worst(rows, n)
    width = max([len(r.name) for r in top] + [9])
    lines = [f"{'tensor':8} {'parameter':{width}} {'shape':>16} {'max abs diff':>13} {'rel diff':>10}  ok"]
    for r in top:
        shape = "x".join(map(str, r.shape)) or "scalar"
        lines.append(
            f"{r.what:8} {r.name:{width}} {shape:>16} {r.max_abs:13.3e} {r.rel:10.3e}  "
            + ("yes" if r.ok else "NO" + (f" ({r.note})" if r.note else ""))
        )
    return "\n".join(lines)


def as_json(rows: Sequence[Row]) -> list[dict[str, object]]:
    return [
        {"tensor": r.what, "name": r.name, "shape": list(r.shape), "max_abs": r.max_abs, "rel": r.rel, "ok": r.ok}
        | ({"note": r.note} if r.note else {})
        for r in rows
    ]


# ---- `partita run --reference` (backends/torch/launch.py) ----------------------------------------
def dump_args(tmp: str) -> list[str]:
    """The program flags of a reference run: deterministic kernels, step-1 gradients, last parameters."""
    grads, params = os.path.join(tmp, "grads"), os.path.join(tmp, "params")
    return ["--deterministic", "--dump-grads", grads, "--dump-steps", "1", "--dump-params", params]


def check_run(
    program: object, steps: int, data: Mapping[str, str], result: Mapping[str, object], tmp: str
) -> dict[str, object]:
    """The single-device run of the program's model, compared with the run's dumps in ``tmp``:
    ``{"reference_losses", "parity": {"ok", "dtype", "rtol", "atol", "num_compared", "failing",
    "worst", "collective_mismatches"}}``. ``ok`` is False when any parameter differs beyond the
    dtype's tolerance or any counted step's collectives differ from the plan's records."""
    from partita.backends.torch.train import reference_run

    prog = program.PROGRAM  # type: ignore[attr-defined]
    precision = prog["stages"][0].get("precision", "f32")  # the plan's dtype, as stage 0 runs it
    training = prog["training"]
    dtype = "fp8" if training.get("fp8") else str(training.get("dtype", "f32"))  # fp8: against the bf16 run
    torch.use_deterministic_algorithms(True, warn_only=True)
    ref = reference_run(
        prog["model"], training, steps, lr_lambda=program.lr_lambda, precision=precision,  # type: ignore[attr-defined]
        data_file=data["data_file"], data_dtype=data["data_dtype"], data_fn=data["data_fn"],
        dump_steps=[1], params=True,
    )  # fmt: skip
    grads = load_dumps(os.path.join(tmp, "grads"), "grads_step1_rank*.pt")
    rows = compare(grads, ref["grads"][1], "grad@1", dtype)
    got = load_dumps(os.path.join(tmp, "params"), "params_rank*.pt")
    rows += compare(got, ref["params"], f"param@{steps}", dtype, adam_noise(training, ref["grads"][1], grads))
    mism = {k: v for k, v in dict(result.get("collective_mismatches") or {}).items() if v}  # type: ignore[call-overload]
    rtol, atol = tolerance("param", dtype)
    grad_rtol, grad_atol = tolerance("grad", dtype)
    failing = [r for r in rows if not r.ok]
    out = {
        "ok": not failing and not mism,
        "dtype": dtype,
        "rtol": rtol,
        "atol": atol,
        "grad_rtol": grad_rtol,
        "grad_atol": grad_atol,
        "num_compared": len(rows),
        "failing": sorted({r.name for r in failing}),
        "worst": as_json(worst(rows)),
        "table": table(rows),
        "collective_mismatches": mism,
    }
    return {"reference_losses": ref["losses"], "parity": out}


def verdict(par: Mapping[str, object]) -> str:
    """What `partita run --reference` prints when the run differs from one device."""
    lines = []
    failing = list(par.get("failing") or [])  # type: ignore[call-overload]
    if failing:
        lines.append(
            f"partita run --reference: {len(failing)} parameter(s) differ from the single-device run beyond the "
            f"{par['dtype']} tolerance (step-1 gradients rtol {par.get('grad_rtol', par['rtol'])}, atol "
            f"{par.get('grad_atol', par['atol'])}; parameters rtol {par['rtol']}, atol {par['atol']}; docs/parity.md). "
            "Worst:"
        )
        lines.append(str(par["table"]))
        more = f", and {len(failing) - SHOW_NAMES} more" if len(failing) > SHOW_NAMES else ""
        lines.append("all that differ: " + ", ".join(failing[:SHOW_NAMES]) + more)  # the table: the worst 10 rows
    mism = dict(par.get("collective_mismatches") or {})  # type: ignore[call-overload]
    if mism:
        lines.append("partita run --reference: the collectives issued differ from the plan's records:")
        lines += [f"  {stage}: {m}" for stage, m in sorted(mism.items())]
    return "\n".join(lines)
