"""Checks that need a model's config and tokenizer but not its weights.

The commands run them before the weights load, so that bad input (a dtype the model overflows,
a --max-model-len past its context, a prompt that does not fit) fails in seconds rather than
after the load. A GGUF's first use still converts it (about a minute): its config and tokenizer
come out of that conversion, which is cached either way.
"""

from __future__ import annotations

from .errors import UserError

DEFAULT_MAX_MODEL_LEN = 2048  # KV rows per request when --max-model-len is not given (or the context, if shorter)


def model_config(model: str, dtype: str):
    """The model's `ModelConfig`, after refusing a dtype it cannot run in."""
    from .engine import DTYPES
    from .models.loading import ModelLoadError, check_dtype, hf_folder, load_config

    try:
        cfg = load_config(hf_folder(model))
        check_dtype(cfg, DTYPES[dtype], model)
    except ModelLoadError as e:
        raise UserError(str(e)) from e
    return cfg


def max_model_len(requested: int | None, cfg, model: str) -> int:
    """--max-model-len, refused past the model's context; by default 2048 or the context if shorter."""
    context = cfg.max_position_embeddings
    if requested is None:
        return min(DEFAULT_MAX_MODEL_LEN, context)
    if requested > context:
        raise UserError(f"--max-model-len {requested} exceeds the context of {model} ({context} tokens)")
    return requested


def tokenizer(model: str):
    from .models.loading import ModelLoadError, load_tokenizer

    try:
        return load_tokenizer(model)
    except ModelLoadError as e:
        raise UserError(str(e)) from e


def check_prompt_lengths(prompt_ids: list[list[int]], max_tokens: int, max_len: int) -> None:
    for i, ids in enumerate(prompt_ids):
        if len(ids) + max_tokens > max_len:
            which = f"prompt {i + 1}" if len(prompt_ids) > 1 else "the prompt"
            raise UserError(f"{which} ({len(ids)} tokens) + --max-tokens {max_tokens} exceeds the context of {max_len} "
                            f"tokens (raise --max-model-len or shorten the prompt)")
