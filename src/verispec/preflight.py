"""Checks that need a model's config and tokenizer but not its weights.

The commands run them before the weights load, so that bad input (a dtype the model overflows,
a --max-model-len past its context, a prompt that does not fit) fails in seconds rather than
after the load. A GGUF's first use still converts it (about a minute): its config and tokenizer
come out of that conversion, which is cached either way.
"""

from __future__ import annotations

from pathlib import Path

from .errors import UserError

DEFAULT_MAX_MODEL_LEN = 2048  # KV rows per request when --max-model-len is not given (or the context, if shorter)


def device(name: str) -> str:
    """The torch device a command runs on (cpu or cuda[:N]), refused before anything loads where this
    machine has none such (torch's own error comes from deep inside the first allocation)."""
    import torch

    try:
        dev = torch.device(name)
    except RuntimeError:
        raise UserError(f"--device {name!r} is not a device; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"--device {name}: this PyTorch ({torch.__version__}) sees no CUDA device")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UserError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type != "cpu":
        raise UserError(f"--device {name}: verispec runs on cpu or cuda")
    return name


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


def cpu_has_bf16_arithmetic(cpuinfo: str = "/proc/cpuinfo") -> bool | None:
    """Whether this x86 CPU multiplies bf16 in hardware (AVX512-BF16 or AMX-BF16), from the kernel's
    flags; None where that cannot be read (not Linux, not x86)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return None
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), None)
    if flags is None:
        return None
    return "avx512_bf16" in flags or "amx_bf16" in flags


def precision_hint(dtype: str, quant: str, device: str) -> str | None:
    """A note for bf16 weights on a CPU with neither bf16 arithmetic nor verispec's own kernel (which
    needs AVX2, FMA and a C compiler: kernels.why_not): there a bf16 GEMM of two or more rows costs
    4-6x a one-row GEMV, and batch-invariant decoding pays it every step (README, "Exactness in
    bf16"); int8 weights run 3-4x faster at batch 1 and change perplexity by <1%."""
    if quant != "none" or not device.startswith("cpu") or dtype not in ("bfloat16", "bf16"):
        return None
    if cpu_has_bf16_arithmetic() is not False:
        return None
    from .kernels import bf16_gemm, why_not

    if bf16_gemm() is not None:
        return None
    return (f"verispec: note: this CPU has no bf16 arithmetic (no AVX512-BF16 or AMX) and verispec's kernel is "
            f"unavailable ({why_not()}), which makes bf16 decoding slow here; --quant int8 is about 4x faster "
            f"(perplexity +0.5-0.8%, README \"Quantized targets\")")


def train_precision_hint(bf16: bool, device: str) -> str | None:
    """A note for bf16 autocast training on a CPU without bf16 arithmetic: there the drafter's and the
    target's GEMMs over thousands of rows run emulated (a P-EAGLE step on Gemma 3 270M, 2 samples of
    256 tokens, on an AVX2-only EPYC: 60 s against 3.5 s in fp32; at 8 samples of 768 tokens a bf16
    step did not finish in 10 minutes, against 30 s in fp32)."""
    if not bf16 or not device.startswith("cpu") or cpu_has_bf16_arithmetic() is not False:
        return None
    return ("verispec: note: this CPU has no bf16 arithmetic (no AVX512-BF16 or AMX), where bf16 autocast trains "
            "many times slower than fp32; --no-bf16 trains in fp32")
