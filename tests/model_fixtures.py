"""User-style model factories for CLI tests (``tests.model_fixtures:branchy``)."""

import torch


class Branchy(torch.nn.Module):
    """Data-dependent control flow: cannot be traced into a static graph."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.lin(x).sum()
        return x.sum()


def branchy():
    return Branchy(), lambda batch, seq, device="meta": {"x": torch.randn(batch, 4, device=device)}
