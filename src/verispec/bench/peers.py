"""Peer systems timed in the same run on the same prompt ids and token counts, greedy, single stream.

- transformers `generate`: plain, prompt lookup (`prompt_lookup_num_tokens`), and assisted
  generation with a draft model (`assistant_model`, k tokens per step, constant schedule), on the
  same Hugging Face folder verispec loads (`models.hf_folder`), same dtype.
- llama.cpp through `llama-cpp-python` (optional extra `verispec[llama]`, built from source), on
  the same GGUF: plain, and prompt lookup (`LlamaPromptLookupDecoding`).
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


def hf_runner(model, pld: int | None = None, ignore_eos: bool = True, assistant=None):
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
        if assistant is not None:
            kw.update(assistant_model=assistant)
        streamer = _FirstToken()
        forwards[0] = 0
        t0 = time.perf_counter()
        out = model.generate(x, streamer=streamer, **kw)
        if x.device.type == "cuda":  # the last kernels finish before the clock stops
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        new = out[0, len(ids):].tolist()
        ttft = (streamer.t - t0) if streamer.t is not None else seconds
        return new, seconds, ttft, streamer.n or len(new), max(forwards[0] - 1, 0), None

    return run


def load_hf(model: str, dtype: str, device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    from ..engine import DTYPES
    from ..models import hf_folder

    hf = AutoModelForCausalLM.from_pretrained(str(hf_folder(model)), dtype=DTYPES[dtype]).to(device)
    hf.generation_config.pad_token_id = hf.generation_config.pad_token_id or 0
    return hf.eval()


def hf_methods(hf, pld_ks: list[int], dtype: str, ignore_eos: bool = True,
               assistants: dict | None = None, k: int = 5) -> list[Method]:
    """assistants: name -> a loaded transformers draft model sharing the target's tokenizer."""
    import transformers

    conf = {"engine": "transformers", "version": transformers.__version__, "dtype": dtype}
    out = [Method("hf plain", "transformers", "hf plain", hf_runner(hf, None, ignore_eos), conf)]
    for n in pld_ks:
        out.append(Method(f"hf pld:{n}", "transformers", "hf plain", hf_runner(hf, n, ignore_eos),
                          {**conf, "prompt_lookup_num_tokens": n}))
    for name, draft in (assistants or {}).items():
        draft.generation_config.num_assistant_tokens = k  # k drafts per step, like verispec's -k
        draft.generation_config.num_assistant_tokens_schedule = "constant"
        draft.generation_config.assistant_confidence_threshold = 0.0  # never stop a draft early
        out.append(Method(f"hf assist:{name}", "transformers", "hf plain",
                          hf_runner(hf, None, ignore_eos, assistant=draft),
                          {**conf, "assistant_model": name, "num_assistant_tokens": k, "schedule": "constant"}))
    return out


def llama_cpp_available() -> bool:
    return find_spec("llama_cpp") is not None


def llama_methods(gguf_path, n_threads: int, n_ctx: int, ignore_eos: bool = True,
                  pld_ks: list[int] = ()) -> list[Method]:
    """llama.cpp greedy decoding of the same prompt ids (its own GGUF numerics): plain, and prompt
    lookup with k tokens per step for each k in pld_ks."""
    import llama_cpp

    def runner(llm):
        evals = [0]
        inner = llm.eval

        def counted_eval(tokens):  # one eval = one forward over the new tokens (prefill included)
            evals[0] += 1
            return inner(tokens)

        llm.eval = counted_eval
        eos = llm.token_eos()

        def run(ids: list[int], max_tokens: int) -> Result:
            out: list[int] = []
            ttft = None
            evals[0] = 0
            t0 = time.perf_counter()
            llm.reset()  # otherwise generate() reuses the KV rows of the previous prompt's common prefix
            for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
                if ttft is None:
                    ttft = time.perf_counter() - t0
                out.append(int(tok))
                if len(out) >= max_tokens or (not ignore_eos and tok == eos):
                    break
            seconds = time.perf_counter() - t0
            return out, seconds, ttft or seconds, 1, max(evals[0] - 1, 0), None

        return run

    def load(draft=None):
        return llama_cpp.Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads,
                               verbose=False, draft_model=draft)

    conf = {"engine": "llama.cpp", "version": llama_cpp.__version__, "gguf": str(gguf_path), "n_threads": n_threads}
    out = [Method("llama.cpp plain", "llama.cpp", "llama.cpp plain", runner(load()), conf)]
    if pld_ks:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        for k in pld_ks:
            out.append(Method(f"llama.cpp pld:{k}", "llama.cpp", "llama.cpp plain",
                              runner(load(LlamaPromptLookupDecoding(num_pred_tokens=k))),
                              {**conf, "prompt_lookup_num_tokens": k}))
    return out
