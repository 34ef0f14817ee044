"""Model zoo (torch): named models built from Hugging Face config classes or plain torch."""

from partita.models.zoo import ModelHandle, ModelInfo, list_models, register_model, resolve_model

__all__ = ["ModelHandle", "ModelInfo", "list_models", "register_model", "resolve_model"]
