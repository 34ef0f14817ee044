"""PyTorch front end: capture an ``nn.Module`` with ``torch.export`` and lower it to Partita's IR.

First step of the flow (model -> IR). The model is usually built under ``torch.device("meta")`` so
nothing is allocated; ``torch.export.export(strict=False)`` gives an ATen graph whose nodes carry
fake-tensor shapes, the module path they came from and a stack trace. Batch and sequence stay
symbolic (``torch.export.Dim`` renamed to sympy symbols ``B`` and ``S``). Every ATen op is mapped
to one :class:`partita.ir.Prim` by the ``RULES`` table in :mod:`partita.frontends.torch_ops`, using
the signature constructors of :mod:`partita.prims` so the JAX tracer produces the same IR.

The forward graph ends at the loss when the model computes one (Hugging Face causal LMs compute it
when ``labels`` are passed); otherwise at the first output tensor.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import os
import re
import sys
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import sympy
import torch
from torch.export.graph_signature import OutputKind

from partita import prims
from partita.errors import ModelError
from partita.frontends import torch_shim
from partita.frontends.torch_ops import RULES, Call, torch_dtype
from partita.ir import Graph, GraphBuilder, Prim, Role

DynamicSpec = Mapping[str, tuple[str, int, int]]
_ROOT = "root"  # attribute name of the user's module inside the capture wrapper
_BATCH_MAX = 1 << 16


class _Capture(torch.nn.Module):
    """Calls the user's module on a dict of tensors and returns the loss (or first output)."""

    def __init__(self, module: torch.nn.Module, positional: bool, consts: Mapping[str, Any]) -> None:
        super().__init__()
        self.root = module
        self.positional = positional
        self.consts = dict(consts)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.positional:
            out = self.root(*batch.values())
        else:
            out = self.root(**batch, **self.consts)
        return _pick_output(out)


def _pick_output(out: Any) -> torch.Tensor:
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(out, torch.Tensor):
        return out
    values = list(out.values()) if isinstance(out, Mapping) else list(out) if isinstance(out, (tuple, list)) else []
    for v in values:
        if isinstance(v, torch.Tensor):
            return v
    raise TypeError(f"model output of type {type(out).__name__} holds no tensor")


def _default_dynamic(inputs: Mapping[str, torch.Tensor], module: torch.nn.Module) -> dict[str, tuple[str, int, int]]:
    """Dim 0 of every input is ``B``; dim 1 of token-like inputs (integer 2-D, or 3-D embeddings) is ``S``."""
    cfg = getattr(module, "config", None)
    seq_max = int(getattr(cfg, "max_position_embeddings", 0) or getattr(cfg, "n_positions", 0) or 8192)
    spec: dict[str, tuple[str, int, int]] = {}
    for key, t in inputs.items():
        if t.dim() >= 1:
            spec[f"{key}:0"] = ("B", 1, _BATCH_MAX)
        tokenish = (t.dim() == 2 and not t.is_floating_point()) or (t.dim() == 3 and key.endswith("embeds"))
        if tokenish:
            spec[f"{key}:1"] = ("S", 2, seq_max)
            if cfg is not None and seq_max != 8192 and int(t.shape[1]) > seq_max:
                raise ModelError(
                    f"sequence length {int(t.shape[1])} of input {key!r} is longer than the {seq_max} positions "
                    f"{type(module).__name__} has (config.max_position_embeddings / n_positions).",
                    f"pass --seq {seq_max} or less, or use a config with more positions.",
                )
    return spec


def _torch_dynamic(spec: DynamicSpec, inputs: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    dims: dict[str, Any] = {}
    out: dict[str, dict[int, Any]] = {k: {} for k in inputs}
    for key, (sym, lo, hi) in spec.items():
        name, _, dim = key.rpartition(":")
        if name not in inputs:
            raise ModelError(f"dynamic spec {key!r} names no input", f"use one of {sorted(inputs)} as '<input>:<dim>'")
        if sym not in dims:
            dims[sym] = torch_shim.make_dim(sym, lo, hi)
        out[name][int(dim)] = dims[sym]
    return {"batch": {k: (v or None) for k, v in out.items()}}


def trace_module(
    module: torch.nn.Module,
    example_inputs: dict[str, Any] | tuple[Any, ...],
    *,
    name: str,
    dynamic: dict[str, tuple[str, int, int]] | None = None,
) -> Graph:
    """Capture ``module`` on ``example_inputs`` (kwargs dict or positional tuple) into an IR graph.

    ``dynamic`` maps ``"<input>:<dim>"`` to ``(symbol, min, max)``, e.g.
    ``{"input_ids:0": ("B", 1, 64), "input_ids:1": ("S", 2, 2048)}``; ``None`` picks ``B`` for dim 0
    of every input and ``S`` for dim 1 of token inputs; ``{}`` traces static shapes. If symbolic
    export fails the trace falls back to static shapes and says why in ``graph.meta``.
    """
    positional = not isinstance(example_inputs, Mapping)
    items = {f"arg{i}": v for i, v in enumerate(example_inputs)} if positional else dict(example_inputs)
    tensors = {k: v for k, v in items.items() if isinstance(v, torch.Tensor)}
    consts = {k: v for k, v in items.items() if not isinstance(v, torch.Tensor)}
    if positional and consts:
        raise ModelError(f"model {name}: positional example inputs must all be tensors", "pass a dict of kwargs")
    if not positional and "use_cache" not in consts and _accepts(module, "use_cache"):
        consts["use_cache"] = False  # HF: no KV cache object in the output
    spec = _default_dynamic(tensors, module) if dynamic is None else dict(dynamic)
    wrapper = _Capture(module, positional, consts)
    meta: dict[str, Any] = {"framework": "torch", "model_class": type(module).__name__}
    start = time.perf_counter()
    ep = None
    if spec:
        try:
            with _quiet_torch_logs():
                ep = torch_shim.export_program(wrapper, (tensors,), _torch_dynamic(spec, tensors))
            meta["shapes"] = "symbolic"
        except ModelError:
            raise
        except Exception as err:  # noqa: BLE001 - any export failure: retry with static shapes
            meta["dynamic_fallback"] = f"symbolic export failed, traced static shapes: {_one_line(err)}"
    if ep is None:
        try:
            with _quiet_torch_logs():
                ep = torch_shim.export_program(wrapper, (tensors,), None)
        except Exception as err:  # noqa: BLE001
            where = _user_frame(err)
            raise ModelError(
                f"model {name} ({type(module).__name__}) cannot be traced by torch.export"
                + (f" at {where}" if where else "")
                + f": {_one_line(err)}",
                _export_fix(err),
            ) from None
        meta["shapes"] = "static"
    meta["export_seconds"] = round(time.perf_counter() - start, 3)
    graph = _Lowering(ep, module, name, spec, list(tensors)).run(meta)
    graph.meta.pop("export_seconds", None)  # keep graphs deterministic; timing goes to the caller
    # Whether the runtime can cut it into pipeline stages is decided on the grouped layers, by the
    # pass `pipeline_cuts` (passes/boundaries.py): graph.meta["no_pipeline"] says why not.
    return graph


# Loggers that print whole FX graphs when export meets data-dependent code; quiet unless TORCH_LOGS asks.
_NOISY_LOGGERS = ("torch.fx.experimental.symbolic_shapes", "torch._export", "torch.export", "torch._dynamo")


@contextlib.contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    """Hold back what export prints; on success replay it, on failure drop it (the ModelError says why).

    torch.export prints a failed trace's partial FX graph straight to stderr and logs it as a warning;
    a user who sets ``TORCH_LOGS`` sees everything.
    """
    if os.environ.get("TORCH_LOGS"):
        yield
        return
    loggers = [logging.getLogger(n) for n in _NOISY_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    held = io.StringIO()
    try:
        with contextlib.redirect_stderr(held):
            yield
        sys.stderr.write(held.getvalue())
    finally:
        for lg, lvl in zip(loggers, levels):
            lg.setLevel(lvl)


def _user_frame(err: BaseException) -> str:
    """``file.py:LINE`` of the user's code torch.export names in its message, or ""."""
    frames = _FRAME.findall(str(err))
    return f"{frames[-1][0].rsplit('/', 1)[-1]}:{frames[-1][1]}" if frames else ""


def _export_fix(err: BaseException) -> str:
    text = f"{type(err).__name__} {err}"
    if "data-dependent" in text or "DataDependent" in text:
        return (
            "remove Python control flow that depends on tensor values (use torch.where / torch.cond, or "
            "branch on shapes and config only)"
        )
    return (
        "make sure the model runs on its example inputs (the factory's example_inputs(batch, seq, device) must "
        "return the keyword arguments forward() takes) and that forward returns a tensor or a loss"
    )


def _accepts(module: torch.nn.Module, param: str) -> bool:
    try:
        return param in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    first = next((ln.strip() for ln in text if ln.strip()), "")
    return f"{type(err).__name__}: {first}"[:400]


_PATH_INDEX = re.compile(r"\[['\"]?([^\]'\"]+)['\"]?\]")
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def _module_path(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    paths = [v[0] for k, v in stack.items() if not str(k).startswith("_empty")]
    if not paths:
        return ""
    path = _PATH_INDEX.sub(r".\1", str(paths[-1])).replace("L.self.", "").replace("L['self'].", "")
    if path == _ROOT:
        return ""
    return path[len(_ROOT) + 1 :] if path.startswith(_ROOT + ".") else path


def _source(node: torch.fx.Node) -> str:
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    if not frames:
        return ""
    file, line = frames[-1]
    return f"{file.rsplit('/', 1)[-1]}:{line}"


def _strip(fqn: str) -> str:
    return fqn[len(_ROOT) + 1 :] if fqn.startswith(_ROOT + ".") else fqn


_FX_SUFFIX = re.compile(r"(.*)_(\d+)$")  # torch.fx's name-suffix rule (Graph._Namespace.create_name)


class _Lowering:
    """Walks an ExportedProgram once and emits IR through a :class:`GraphBuilder`."""

    def __init__(
        self, ep: Any, module: torch.nn.Module, name: str, spec: DynamicSpec, input_keys: Sequence[str]
    ) -> None:
        self.ep = ep
        self.module = module
        self.b = GraphBuilder(name)
        self.spec = spec
        self.input_keys = list(input_keys)
        self.env: dict[str, str] = {}  # fx node name -> IR tensor name
        self.multi: dict[str, list[str | None]] = {}  # fx node name -> IR names of its tuple outputs
        self.subs: dict[sympy.Symbol, sympy.Symbol] = {}
        self.num_opaque = 0
        self.num_named: dict[str, int] = {}  # name base -> nodes kept with it so far

    def _node_name(self, fx_name: str) -> str:
        """``base_k`` for the k-th kept node of fx name base ``base`` (``mul``, ``mul_1``, ...).

        torch.fx numbers every node it creates, the symbolic-int arithmetic the IR drops included,
        and how many of those a block spends shrinks as export's shape cache warms, so fx's numbers
        depend on how many blocks came before. Counting only the nodes kept gives every block the
        same count per base: a full trace and ``repeat.expand_blocks``'s copies name alike."""
        m = _FX_SUFFIX.match(fx_name)
        base = m.group(1) if m else fx_name
        while True:
            k = self.num_named.get(base, 0)
            self.num_named[base] = k + 1
            name = f"{base}_{k}" if k else base
            if name not in self.b.tensors:
                return name

    # ---- shapes ------------------------------------------------------------------------
    def expr(self, value: Any) -> sympy.Expr:
        e = torch_shim.sym_expr(value)
        return e.xreplace(self.subs) if self.subs else e

    def shape(self, t: torch.Tensor) -> tuple[sympy.Expr, ...]:
        return tuple(self.expr(d) for d in t.shape)

    def _bind_symbols(self, user_nodes: Sequence[torch.fx.Node]) -> dict[str, str]:
        """Rename export's ``s0, s1`` to the requested names (``B``, ``S``) and record bounds."""
        specialised: dict[str, str] = {}
        ranges = {str(k): v for k, v in self.ep.range_constraints.items()}
        for key, node in zip(self.input_keys, user_nodes):
            val = node.meta["val"]
            for spec_key, (sym, _lo, _hi) in self.spec.items():
                name, _, dim = spec_key.rpartition(":")
                if name != key:
                    continue
                e = torch_shim.sym_expr(val.shape[int(dim)])
                if isinstance(e, sympy.Symbol):
                    target = sympy.Symbol(sym)
                    self.subs[e] = target
                    r = ranges.get(str(e))
                    lo, hi = (int(r.lower), int(r.upper)) if r is not None else (_lo, _hi)
                    self.b.symbols[sym] = (lo, hi)
                else:
                    specialised[spec_key] = str(e)
        return specialised

    # ---- placeholders ------------------------------------------------------------------
    def _placeholders(self) -> None:
        sig = self.ep.graph_signature
        to_param = dict(sig.inputs_to_parameters)
        to_buffer = {**sig.inputs_to_buffers, **sig.inputs_to_lifted_tensor_constants}
        groups: dict[int, list[str]] = {}
        for fqn, p in self.module.named_parameters(remove_duplicate=False):
            groups.setdefault(id(p), []).append(fqn)
        canon: dict[str, tuple[str, tuple[str, ...]]] = {}
        for names in groups.values():
            for fqn in names:
                canon[fqn] = (names[0], tuple(names[1:]))
        nodes = [n for n in self.ep.graph.nodes if n.op == "placeholder"]
        user = [n for n in nodes if n.name in sig.user_inputs]
        specialised = self._bind_symbols(user)
        if specialised:
            self.b_meta["specialised_dims"] = specialised
        for n in nodes:
            val = n.meta.get("val")
            if n.name in to_param:
                fqn, aliases = canon.get(_strip(to_param[n.name]), (_strip(to_param[n.name]), ()))
                if fqn not in self.b.tensors:
                    self.b.tensor(fqn, self.shape(val), torch_dtype(val.dtype), Role.PARAMETER, fqn, aliases)
                self.env[n.name] = fqn
            elif n.name in to_buffer:
                fqn = _strip(to_buffer[n.name])
                if fqn not in self.b.tensors:
                    self.b.tensor(fqn, self.shape(val), torch_dtype(val.dtype), Role.BUFFER, fqn)
                self.env[n.name] = fqn
        for key, n in zip(self.input_keys, user):
            val = n.meta["val"]
            self.env[n.name] = self.b.tensor(key, self.shape(val), torch_dtype(val.dtype), Role.INPUT)

    # ---- nodes -------------------------------------------------------------------------
    def _call(self, n: torch.fx.Node) -> None:
        if n.target is __import__("operator").getitem:
            src = n.args[0]
            if isinstance(src, torch.fx.Node) and src.name in self.multi:
                out = self.multi[src.name][int(n.args[1])]
                if out is not None:
                    self.env[n.name] = out
            return
        val = n.meta.get("val")
        outs_val = list(val) if isinstance(val, (tuple, list)) else [val]
        if not any(isinstance(v, torch.Tensor) for v in outs_val):
            return  # symbolic-int arithmetic, asserts: no tensor result
        op = torch_shim.op_name(n.target)
        module = _module_path(n)
        call = Call.from_node(n, op, self)
        self._check_bounded(n, op, module, call.out_shapes)
        rule = RULES.get(op) or RULES.get(op.rstrip("_") if not op.startswith("__") else op)
        result = rule(call) if rule is not None else None
        if result is None:
            self.num_opaque += 1
            warnings.warn(
                f"partita: no IR rule for torch op {op!r} (module {module or '<root>'}); kept as OPAQUE "
                "(priced by bytes, run replicated). To shard it, add a rule for it to RULES in "
                "partita/frontends/torch_ops.py",
                stacklevel=3,
            )
            prim, sig, inputs = (
                Prim.OPAQUE,
                prims.opaque([len(s) for s in call.in_shapes], [len(s) for s in call.out_shapes]),
                call.inputs,
            )
        else:
            prim, sig, inputs = result[0], result[1], (call.inputs if len(result) < 3 else result[2])
        ir_name = self._node_name(n.name)
        out_names = [f"{ir_name}.{i}" for i in range(len(call.out_shapes))] if call.is_tuple else [ir_name]
        self.b.add(
            prim,
            inputs,
            [(o, shp, dt) for o, shp, dt in zip(out_names, call.out_shapes, call.out_dtypes)],
            sig,
            target=str(n.target),
            attrs=call.attrs,
            module=module,
            source=_source(n),
            name=ir_name,
        )
        if call.is_tuple:
            it = iter(out_names)
            self.multi[n.name] = [next(it) if isinstance(v, torch.Tensor) else None for v in outs_val]
        else:
            self.env[n.name] = ir_name

    def _check_bounded(self, n: torch.fx.Node, op: str, module: str, shapes: Sequence[Sequence[Any]]) -> None:
        """Refuse output sizes that depend on tensor values (torch's unbacked ``u0``): no bound to plan for."""
        free = {str(x) for shp in shapes for d in shp for x in getattr(d, "free_symbols", ())}
        unbacked = sorted(x for x in free if x.startswith("u") and x[1:].isdigit())
        if unbacked:
            where = _source(n)
            raise ModelError(
                f"op {op!r} (module {module or '<root>'}{', ' + where if where else ''}) has an output size that "
                f"depends on tensor values ({', '.join(unbacked)}), with no bound Partita can plan memory for.",
                "replace value-dependent shapes (boolean-mask indexing, nonzero, unique) with fixed-size ops, e.g. "
                "torch.where(mask, x, 0) or multiplying by the mask, or pad the result to a known maximum size.",
            )

    def run(self, meta: dict[str, Any]) -> Graph:
        self.b_meta = meta
        self._placeholders()
        for n in self.ep.graph.nodes:
            if n.op == "call_function":
                self._call(n)
        user_outs = [s.arg.name for s in self.ep.graph_signature.output_specs if s.kind == OutputKind.USER_OUTPUT]
        self.b.outputs = [self.env[o] for o in user_outs if o in self.env]
        meta["num_opaque"] = self.num_opaque
        return self.b.build(meta)
