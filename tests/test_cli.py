"""The CLI: one-line errors with a non-zero exit code and no traceback; --json output."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def cli(*args, timeout=600):
    r = subprocess.run([sys.executable, "-m", "verispec.cli", *args], capture_output=True, text=True, timeout=timeout)
    return r.returncode, r.stdout, r.stderr


def assert_user_error(rc, err, needle):
    assert rc == 2, err
    assert "Traceback" not in err
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("verispec: error:")]
    assert len(lines) == 1 and needle in lines[0], err


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--temperature", "-1"], "temperature must be >= 0"),
        (["--top-p", "0"], "top_p must be in (0, 1]"),
        (["--top-p", "1.5"], "top_p must be in (0, 1]"),
        (["--top-k", "0"], "top_k must be an integer >= 1"),
        (["-k", "-2"], "num_draft_tokens must be >= 0"),
        (["--dtype", "int3"], "unknown dtype"),
        (["--drafter", "magic"], "unknown drafter"),
    ],
)
def test_invalid_settings(args, needle):
    rc, _, err = cli("generate", "hello", "--model", "gemma3-270m", *args)
    assert_user_error(rc, err, needle)


def test_unknown_model_path(tmp_path):
    rc, _, err = cli("generate", "hello", "--model", str(tmp_path / "nope"))
    assert_user_error(rc, err, "model path not found")


def test_folder_without_config(tmp_path):
    rc, _, err = cli("generate", "hello", "--model", str(tmp_path))
    assert_user_error(rc, err, "has no config.json")


def test_unreadable_gguf(tmp_path, monkeypatch):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf at all" * 10)
    rc, _, err = cli("generate", "hello", "--model", str(bad))
    assert_user_error(rc, err, "is not a GGUF file")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\x00" * 7)
    rc, _, err = cli("generate", "hello", "--model", str(truncated))
    assert_user_error(rc, err, "cannot read GGUF")


def test_missing_prompt():
    rc, _, err = cli("generate")
    assert_user_error(rc, err, "no prompt given")


@pytest.mark.real_model
def test_prompt_longer_than_context():
    rc, _, err = cli("generate", "word " * 100, "--max-model-len", "64", "--max-tokens", "8")
    assert_user_error(rc, err, "exceeds the context of 64 tokens")


@pytest.mark.real_model
def test_json_output_with_compare():
    rc, out, err = cli("generate", "def add(a, b):", "--max-tokens", "12", "--ignore-eos", "--compare", "--json",
                       "--dtype", "float32")
    assert rc == 0, err
    r = json.loads(out)
    o = r["outputs"][0]
    assert len(o["token_ids"]) == 12 and isinstance(o["text"], str)
    assert r["baseline"]["outputs_identical"] == [True]
    for key in ("tau", "acceptance_rate", "acceptance_per_position_conditional", "tokens_per_second"):
        assert key in r["stats"]
    assert r["speedup"] > 0
