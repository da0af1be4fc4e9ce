"""The training prompt mixture: kinds, proportions in every prefix, decontamination, dedup."""

from __future__ import annotations

from collections import Counter

from verispec.train.mixture import EvalOverlap, classify, interleave, mixture


def test_classify():
    assert classify("Write a python function that sorts a list") == "code"
    assert classify("```\nx = 1\n```\nwhat does this print?") == "code"
    assert classify("Summarize the plot of Hamlet in three sentences") == "instruction"
    assert classify("  explain photosynthesis to a child") == "instruction"
    assert classify("What do you think about the weather in spring?") == "chat"


def test_every_prefix_holds_the_weights():
    buckets = {"chat": list(range(1000)), "code": list(range(1000, 2000)), "instruction": list(range(2000, 3000))}
    out = interleave(buckets, {"chat": 0.4, "code": 0.3, "instruction": 0.3}, 1000)
    assert len(out) == len(set(out)) == 1000
    for n in (10, 50, 333, 1000):
        c = Counter("chat" if x < 1000 else "code" if x < 2000 else "instruction" for x in out[:n])
        assert abs(c["chat"] - 0.4 * n) <= 1 and abs(c["code"] - 0.3 * n) <= 1, (n, c)
    # a kind that runs dry drops out; the others fill the rest
    out = interleave({"chat": [1, 2], "code": list(range(10, 20))}, {"chat": 0.5, "code": 0.5}, 8)
    assert sorted(out[:4]) == [1, 2, 10, 11] and out[4:] == [12, 13, 14, 15]


def test_mixture_drops_evaluation_overlap_duplicates_and_non_latin_and_is_prefix_stable():
    evals = ["Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences",
             "def add(a, b):"]
    pool = [("a", "Please compose an engaging travel blog post about a recent trip to Hawaii, highlighting food"),
            ("b", "def add(a, b):"),  # equals a short evaluation prompt
            ("c", "What is the capital of France?"),
            ("d", "what is the   capital of france?"),  # a duplicate after normalisation
            ("e", "Write a poem about the sea"),
            ("f", "파이썬으로 정렬 함수를 작성해 주세요"),  # mostly not Latin script
            ("g", "How do I reverse a list in Python?"),
            ("h", "Tell me a joke"),
            ("i", "Is it going to rain tomorrow?")]
    out = mixture(10, seed=1, pool=pool, eval_texts=evals)
    texts = [m["messages"][0]["content"] for m in out]
    assert len(texts) == 5
    assert not any("Hawaii" in t or t.startswith("def add") or t.startswith("파") for t in texts)
    assert sum(t.lower().startswith("what is the") for t in texts) == 1
    assert {m["kind"] for m in out} == {"chat", "code", "instruction"}
    assert mixture(3, seed=1, pool=pool, eval_texts=evals) == out[:3]  # a larger n extends, never reshuffles


def test_eval_overlap_by_shingles():
    ov = EvalOverlap(["one two three four five six seven eight nine", "hi there"])
    assert ov.overlaps("zero one two three four five six seven eight")
    assert not ov.overlaps("one two three four five six seven nine eight")
    assert ov.overlaps("Hi, there!") and not ov.overlaps("hi there you")
