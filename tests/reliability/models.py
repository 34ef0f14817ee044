"""User-style model factories for the bad-input catalogue (``tests.reliability.models:<name>``).

Each returns ``(module, example_inputs(batch, seq, device))`` like a user's factory, except the
ones that are broken on purpose; all are tiny so tracing them costs well under a second.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Inputs = Callable[..., dict[str, torch.Tensor]]


def _inputs(batch: int, seq: int, device: str = "meta") -> dict[str, torch.Tensor]:
    return {"x": torch.randn(batch, 4, device=device)}


class Lgamma(torch.nn.Module):
    """Uses ``torch.lgamma``, an op with no IR rule: kept as OPAQUE (replicated), with a warning."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.lgamma(self.lin(x).abs() + 1).sum()


class Masked(torch.nn.Module):
    """Boolean-mask indexing: the output size depends on the values (unbacked, no bound)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y[y > 0].sum()


class Nonzero(torch.nn.Module):
    """Gathers the rows ``nonzero`` picks: a value-dependent number of rows."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        rows = torch.nonzero(y[:, 0] > 0).squeeze(1)
        return self.lin(y[rows]).sum()


class Wide(torch.nn.Module):
    """One 8192 x 8192 linear (67M parameters, ~1.1 GB with bf16 Adam state): for memory refusals."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8192, 8192)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).sum()


class Broken(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        raise ValueError("the user's __init__ failed")


def lgamma() -> tuple[torch.nn.Module, Inputs]:
    return Lgamma(), _inputs


def masked() -> tuple[torch.nn.Module, Inputs]:
    return Masked(), _inputs


def nonzero() -> tuple[torch.nn.Module, Inputs]:
    return Nonzero(), _inputs


def wide() -> tuple[torch.nn.Module, Inputs]:
    return Wide(), lambda batch, seq, device="meta": {"x": torch.zeros(batch, 8192, device=device)}


def wrong_inputs() -> tuple[torch.nn.Module, Inputs]:
    """Example inputs name an argument ``forward`` does not take."""
    return Lgamma(), lambda batch, seq, device="meta": {"y": torch.randn(batch, 4, device=device)}


def raises() -> tuple[torch.nn.Module, Inputs]:
    return Broken(), _inputs


def not_a_model() -> Any:
    return 42


def _raising_inputs(batch: int, seq: int, device: str = "meta") -> dict[str, torch.Tensor]:
    raise KeyError("the user's example inputs need a tokenizer")


def inputs_raise() -> tuple[torch.nn.Module, Inputs]:
    """The example-inputs function raises."""
    return Lgamma(), _raising_inputs


def inputs_not_callable() -> tuple[torch.nn.Module, Any]:
    """The second item is not a function."""
    return Lgamma(), {"x": [1, 2]}


def exits() -> Any:
    """The factory calls ``sys.exit(3)`` (a script's habit)."""
    import sys

    sys.exit(3)


def data_fn_two_args(step: int, rows: Any) -> Any:
    """A ``--data-fn`` of the wrong signature: ``(step, rows)`` without ``seq_len``."""
    raise AssertionError("never called: refused before launch")


data_fn_not_callable = 42
