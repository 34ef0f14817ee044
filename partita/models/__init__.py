"""Model zoo (torch): named models built from Hugging Face config classes or plain torch.

The names below load ``zoo`` (and torch) on first use, so ``partita.models.catalog`` (the zoo's
names and sizes for ``partita models``) imports no torch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from partita.models.zoo import ModelHandle, ModelInfo, list_models, register_model, resolve_model

__all__ = ["ModelHandle", "ModelInfo", "list_models", "register_model", "resolve_model"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from partita.models import zoo

        return getattr(zoo, name)
    raise AttributeError(f"module 'partita.models' has no attribute {name!r}")
