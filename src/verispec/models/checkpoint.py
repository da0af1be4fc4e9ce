"""Make a folder converted from a GGUF a complete Hugging Face checkpoint, one that transformers
and vLLM load unchanged.

transformers' GGUF reader gives weights, a config and a tokenizer, but the saved config has
`"architectures": null` (vLLM then takes the folder for an embedding model and fails), there is no
generation_config.json (vLLM and `generate` then stop only at the config's single EOS), and a
Gemma base model has no chat template (vLLM's chat endpoint refuses to serve it). This module
writes those three from the GGUF's own metadata. It runs after a conversion and, once, on a folder
converted by an older verispec (`FORMAT` below is the version written into its DONE file).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

FORMAT = 2  # 1: weights, config, tokenizer; 2: + architectures, generation_config.json, chat template

# GGUF keys of the tokens that end generation, as llama.cpp counts them (its "end of generation"
# set): the EOS, and the end-of-turn / end-of-message tokens of chat models that have them.
_EOG_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def done_marker(source: Path) -> str:
    """The DONE file's text: which GGUF the folder came from, and in which format it was written."""
    return json.dumps({"source": str(source), "format": FORMAT})


def folder_format(folder: Path) -> int:
    """The format a converted folder was written in; 1 for a DONE file holding only a path."""
    try:
        done = json.loads((folder / "DONE").read_text())
    except (OSError, ValueError):
        return 1
    return int(done.get("format", 1)) if isinstance(done, dict) else 1


def gguf_metadata(path: Path) -> dict:
    """The few metadata values a checkpoint needs: special token ids and the chat template."""
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields

    def value(key):
        f = fields.get(key)
        return None if f is None else f.contents()

    eos = [int(v) for v in (value(k) for k in _EOG_KEYS) if v is not None]
    return {
        "bos_token_id": value("tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(dict.fromkeys(eos)),
        "pad_token_id": value("tokenizer.ggml.padding_token_id"),
        "chat_template": value("tokenizer.chat_template"),
    }


def complete(folder: Path, meta: dict) -> None:
    """Write `architectures`, generation_config.json and the chat template into `folder`. Each file
    is replaced atomically and the result depends only on `meta` and the folder, so two processes
    completing the same folder at once leave the same files."""
    config = json.loads((folder / "config.json").read_text())
    if not config.get("architectures"):
        config["architectures"] = [causal_lm_class(config["model_type"])]
        _write_json(folder / "config.json", config)
    _write_json(folder / "generation_config.json", generation_config(meta, config))
    template = meta.get("chat_template") or _known_template(config["model_type"])
    tok_cfg_path = folder / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text()) if tok_cfg_path.exists() else {}
    if template and not tok_cfg.get("chat_template") and not (folder / "chat_template.jinja").exists():
        tok_cfg["chat_template"] = template
        _write_json(tok_cfg_path, tok_cfg)


def generation_config(meta: dict, config: dict) -> dict:
    """bos/eos/pad as the GGUF says (the config's values where the GGUF has none)."""
    out = {}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = meta.get(key)
        v = config.get(key) if v is None or v == [] else v
        if isinstance(v, list) and len(v) == 1:
            v = v[0]
        if v is not None:
            out[key] = v
    return out


def causal_lm_class(model_type: str) -> str:
    """transformers' causal-LM class for a model type (gemma3_text -> Gemma3ForCausalLM); vLLM
    picks its implementation by the same name."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    except KeyError:
        raise ValueError(f"transformers has no causal LM for model type {model_type!r}") from None


def _known_template(model_type: str) -> str | None:
    """Gemma base models ship without a template; verispec formats their chats in Gemma's turn
    format (chat.py), and the folder gets the same format as a template."""
    from ..chat import GEMMA_CHAT_TEMPLATE

    return GEMMA_CHAT_TEMPLATE if model_type.startswith("gemma") else None


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)
