"""Target and draft models: configuration, our forward, and loading from disk."""

from .config import ModelConfig
from .loading import DEFAULT_MODEL, ModelLoadError, hf_folder, load_model, load_tokenizer
from .model import CausalLM, ForwardOutput

__all__ = [
    "DEFAULT_MODEL", "CausalLM", "ForwardOutput", "ModelConfig", "ModelLoadError",
    "hf_folder", "load_model", "load_tokenizer",
]
