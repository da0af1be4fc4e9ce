"""Peer systems timed in the same run on the same prompt ids and token counts, greedy, single stream.

- transformers `generate`: plain, and prompt lookup (`prompt_lookup_num_tokens`), on the same
  Hugging Face folder verispec loads (`models.hf_folder`), same dtype.
- llama.cpp through `llama-cpp-python`, on the same GGUF, when that package is importable (it is
  never installed or built here).
"""

from __future__ import annotations

import time
from importlib.util import find_spec

import torch

from .runner import Method, Result


class _FirstToken:
    """A transformers streamer that only notes when the first generated token arrives."""

    def __init__(self):
        self.calls, self.t, self.n = 0, None, 0

    def put(self, value):
        self.calls += 1
        if self.calls == 2 and self.t is None:  # the first put is the prompt
            self.t, self.n = time.perf_counter(), int(value.numel())

    def end(self):
        pass


def hf_runner(model, pld: int | None = None, ignore_eos: bool = True):
    forwards = [0]
    model.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))

    @torch.inference_mode()
    def run(ids: list[int], max_tokens: int) -> Result:
        x = torch.tensor([ids], device=model.device)
        kw = dict(max_new_tokens=max_tokens, do_sample=False, temperature=None, top_p=None, top_k=None,
                  attention_mask=torch.ones_like(x))
        if ignore_eos:  # generate exactly max_tokens, continuing past <eos> like verispec's ignore_eos
            kw.update(eos_token_id=None)
        if pld:
            kw.update(prompt_lookup_num_tokens=pld)
        streamer = _FirstToken()
        forwards[0] = 0
        t0 = time.perf_counter()
        out = model.generate(x, streamer=streamer, **kw)
        seconds = time.perf_counter() - t0
        new = out[0, len(ids):].tolist()
        ttft = (streamer.t - t0) if streamer.t is not None else seconds
        return new, seconds, ttft, streamer.n or len(new), max(forwards[0] - 1, 0), None

    return run


def load_hf(model: str, dtype: str):
    from transformers import AutoModelForCausalLM

    from ..engine import DTYPES
    from ..models import hf_folder

    hf = AutoModelForCausalLM.from_pretrained(str(hf_folder(model)), dtype=DTYPES[dtype])
    hf.generation_config.pad_token_id = hf.generation_config.pad_token_id or 0
    return hf.eval()


def hf_methods(hf, pld_ks: list[int], dtype: str, ignore_eos: bool = True) -> list[Method]:
    import transformers

    conf = {"engine": "transformers", "version": transformers.__version__, "dtype": dtype}
    out = [Method("hf plain", "transformers", "hf plain", hf_runner(hf, None, ignore_eos), conf)]
    for k in pld_ks:
        out.append(Method(f"hf pld:{k}", "transformers", "hf plain", hf_runner(hf, k, ignore_eos),
                          {**conf, "prompt_lookup_num_tokens": k}))
    return out


def llama_cpp_available() -> bool:
    return find_spec("llama_cpp") is not None


def llama_methods(gguf_path, n_threads: int, n_ctx: int, ignore_eos: bool = True) -> list[Method]:
    """llama.cpp plain greedy decoding of the same prompt ids (its own GGUF numerics)."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads,
                          verbose=False)
    eos = llm.token_eos()

    def run(ids: list[int], max_tokens: int) -> Result:
        out: list[int] = []
        ttft = None
        t0 = time.perf_counter()
        llm.reset()  # otherwise generate() reuses the KV rows of the previous prompt's common prefix
        for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            if ttft is None:
                ttft = time.perf_counter() - t0
            out.append(int(tok))
            if len(out) >= max_tokens or (not ignore_eos and tok == eos):
                break
        seconds = time.perf_counter() - t0
        return out, seconds, ttft or seconds, 1, max(len(out) - 1, 0), None

    conf = {"engine": "llama.cpp", "version": llama_cpp.__version__, "gguf": str(gguf_path), "n_threads": n_threads}
    return [Method("llama.cpp plain", "llama.cpp", "llama.cpp plain", run, conf)]
