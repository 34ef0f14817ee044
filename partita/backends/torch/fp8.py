"""FP8 training in the emitted torch program (issue 36 item 2): torchao's float8 conversion, or a refusal.

The program of a plan writes, in the ``setup_stage_<i>`` of each stage whose ``Stage.fp8`` names a
recipe (``search/pricing/fp8.py`` prices it; a stage without it trains in bf16), literally::

    convert_to_float8_training, Float8LinearConfig = fp8.torchao_float8()
    module = convert_to_float8_training(
        module, config=Float8LinearConfig.from_recipe_name("tensorwise"), module_filter_fn=fp8.runs_in_fp8
    )

before recompute, autocast and FSDP2 wrap the stage (torchao's order: convert, then shard). Each
swapped ``Float8Linear`` keeps its weight as the plan's master copy (f32 under autocast, sharded
f32 under FSDP2's ``MixedPrecisionPolicy``), so gradients and optimizer state are what a bf16 plan
keeps; only the three GEMMs of the linear run in FP8 with dynamic scales. On CPU ranks torch runs
torch's scaled matmul on the CPU (torch >= 2.10 has a CPU kernel), so the same program trains in tests.

torchao is an optional dependency (``pip install partita[fp8]``): :func:`torchao_float8` refuses with
one paragraph (a :class:`~partita.errors.ConfigError`: the program prints it and exits 2) when it is
missing or outside the tested range.
"""

from __future__ import annotations

from typing import Any

from partita.errors import ConfigError

TORCHAO_RANGE = ((0, 18), (0, 19))  # tested with 0.18.0; pyproject's [fp8] extra pins >=0.18,<0.19


def torchao_float8() -> tuple[Any, Any]:
    """``(convert_to_float8_training, Float8LinearConfig)`` from torchao, or a ConfigError saying how to install it."""
    fix = 'install it where the program runs: pip install "partita[fp8]" (torchao>=0.18,<0.19), or recompile with --precision bf16.'
    try:
        import torchao
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as err:
        raise ConfigError(
            f"this plan trains in fp8 (torchao float8 training), but torchao cannot be imported ({err}).", fix
        ) from None
    got = tuple(int(x) for x in torchao.__version__.split("+")[0].split(".")[:2] if x.isdigit())
    lo, hi = TORCHAO_RANGE
    if not lo <= got < hi:
        raise ConfigError(
            f"this plan trains in fp8 with torchao's float8 API of 0.18, but torchao {torchao.__version__} is installed.",
            fix,
        )
    return convert_to_float8_training, Float8LinearConfig


def runs_in_fp8(module: Any, fqn: str) -> bool:
    """torchao's hardware rule: a linear runs in FP8 only when both its sizes are multiples of 16."""
    import torch

    if not isinstance(module, torch.nn.Linear):
        return True  # a container: look inside
    return module.in_features % 16 == 0 and module.out_features % 16 == 0
