"""The CLI: one-line errors with exit code 2 and no traceback, checked before the weights load;
the shared engine options; --help without torch; --json output."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout

import pytest

from conftest import build_hf
from verispec import kernels
from verispec.cli import main

VOCAB = 160  # conftest's tiny models


def cli(*args, timeout=600):
    """`verispec ARGS` in a fresh interpreter: (exit code, stdout, stderr)."""
    r = subprocess.run([sys.executable, "-m", "verispec.cli", *args], capture_output=True, text=True, timeout=timeout)
    return r.returncode, r.stdout, r.stderr


def run(*args):
    """`verispec ARGS` in this process (seconds faster than `cli`): (exit code, stdout, stderr). An
    unexpected exception propagates and fails the test, as a traceback would."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            rc = main(list(args))
        except SystemExit as e:  # argparse: --help, or a usage error through Parser.error
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


def assert_user_error(rc, err, needle):
    assert rc == 2, err
    assert "Traceback" not in err
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("verispec: error:")]
    assert len(lines) == 1 and needle in lines[0], err
    assert not any(ln.startswith("usage:") for ln in err.splitlines()), err  # one line, not argparse's usage dump


def _tokenizer():
    """A word-level tokenizer over the tiny models' 160 ids: '<bos>' is prepended, 'w7' is id 7."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3, **{f"w{i}": i for i in range(4, VOCAB)}}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    t.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Factory: tiny(family, weights=True) -> a Hugging Face folder of a tiny random model (context
    256) with a tokenizer; weights=False leaves out the safetensors, so anything that loads the
    weights fails with "has no .safetensors weights"."""
    made = {}

    def make(family: str = "llama", weights: bool = True):
        key = (family, weights)
        if key not in made:
            d = tmp_path_factory.mktemp(f"{family}-{'w' if weights else 'noweights'}")
            build_hf(family).save_pretrained(d)
            _tokenizer().save_pretrained(d)
            if not weights:
                for f in d.glob("*.safetensors"):
                    f.unlink()
            made[key] = str(d)
        return made[key]

    return make


# ---- argument errors: argparse's, as one line -----------------------------------------------


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--temperature", "-1"], "temperature must be >= 0"),
        (["--top-p", "0"], "top_p must be in (0, 1]"),
        (["--top-p", "1.5"], "top_p must be in (0, 1]"),
        (["--top-k", "0"], "top_k must be an integer >= 1"),
        (["-k", "-2"], "must be between 0 and 64, got -2"),
        (["-k", "100"], "must be between 0 and 64, got 100"),
        (["--threads", "-1"], "argument --threads: must be >= 1, got -1"),
        (["--threads", "0"], "argument --threads: must be >= 1, got 0"),
        (["--threads", "two"], "argument --threads: expected an integer, got 'two'"),
        (["--max-tokens", "0"], "argument --max-tokens: must be >= 1"),
        (["--max-model-len", "1"], "argument --max-model-len: must be >= 2"),
        (["--dtype", "int3"], "unknown dtype 'int3'"),
    ],
)
def test_invalid_settings(args, needle):
    rc, _, err = run("generate", "hello", "--model", "gemma3-270m", *args)
    assert_user_error(rc, err, needle)


@pytest.mark.real_model
def test_unknown_drafter():
    rc, _, err = cli("generate", "hello", "--drafter", "magic", "--max-tokens", "4")
    assert_user_error(rc, err, "unknown drafter")


def test_engine_options_are_shared():
    """generate, serve, bench and data take the engine flags from one parent parser: the same
    names (old spellings included), types, defaults and errors."""
    from verispec.cli import build_parser

    p = build_parser()
    common = ["--model", "m", "--dtype", "float32", "--max-model-len", "512", "--threads", "1"]
    for cmd, extra in [("generate", ["--drafter", "none", "-k", "3", "--device", "cpu", "--exact", "x"]),
                       ("serve", ["--drafter", "none", "--num-draft-tokens", "3", "--device", "cpu", "--exact"]),
                       ("bench", ["-k", "3"]),
                       ("data", ["--device", "cpu", "--prompts", "mtbench", "--num-samples", "1", "--out", "o"])]:
        a = p.parse_args([cmd, *common, *extra])
        assert (a.model, a.dtype, a.max_model_len, a.threads) == ("m", "float32", 512, 1), cmd
        if cmd != "data":
            assert a.num_draft_tokens == 3
        d = p.parse_args([cmd] + (["--prompts", "x", "--num-samples", "1", "--out", "o"] if cmd == "data" else []))
        assert (d.model, d.dtype, d.max_model_len, d.threads) == ("gemma3-270m", "bfloat16", None, None), cmd
    for cmd in ("generate", "serve", "bench"):
        rc, _, err = run(cmd, "--threads", "-1")
        assert_user_error(rc, err, "argument --threads: must be >= 1, got -1")


def test_quant_option_everywhere_and_checked(tmp_path, monkeypatch):
    from verispec import preflight
    from verispec.cli import build_parser
    from verispec.models.quant import QUANT_MODES as MODEL_QUANT_MODES
    from verispec.options import QUANT_MODES

    assert QUANT_MODES == MODEL_QUANT_MODES == ("none", "int8", "int4")
    p = build_parser()
    for cmd, extra in [("generate", ["x"]), ("serve", []), ("profile", []),
                       ("data", ["--prompts", "x", "--num-samples", "1", "--out", "o"])]:
        assert p.parse_args([cmd, *extra]).quant == "none", cmd
        assert p.parse_args([cmd, *extra, "--quant", "int8"]).quant == "int8", cmd
    assert p.parse_args(["bench", "--quant", "none,int4"]).quant == ["none", "int4"]
    rc, _, err = run("generate", "x", "--quant", "int3")
    assert_user_error(rc, err, "argument --quant: invalid choice: 'int3'")
    # the hint for bf16 on a CPU without bf16 arithmetic, read from the kernel's flags
    info = tmp_path / "cpuinfo"
    info.write_text("processor : 0\nflags\t\t: fpu avx2 avx512f avx512_vnni\n")
    assert preflight.cpu_has_bf16_arithmetic(str(info)) is False
    info.write_text("processor : 0\nflags\t\t: fpu avx2 avx512f avx512_bf16\n")
    assert preflight.cpu_has_bf16_arithmetic(str(info)) is True
    assert preflight.cpu_has_bf16_arithmetic(str(tmp_path / "missing")) is None
    monkeypatch.setattr(preflight, "cpu_has_bf16_arithmetic", lambda: False)
    monkeypatch.setattr(kernels, "bf16_gemm", lambda: object())  # verispec's kernel makes bf16 fast anyway
    assert preflight.precision_hint("bfloat16", "none", "cpu") is None
    monkeypatch.setattr(kernels, "bf16_gemm", lambda: None)
    monkeypatch.setattr(kernels, "why_not", lambda: "no C compiler (cc) on PATH")
    hint = preflight.precision_hint("bfloat16", "none", "cpu")
    assert "--quant int8" in hint and "no C compiler" in hint
    assert preflight.precision_hint("bfloat16", "int8", "cpu") is None
    assert preflight.precision_hint("float32", "none", "cpu") is None
    assert preflight.precision_hint("bfloat16", "none", "cuda") is None
    assert "--no-bf16" in preflight.train_precision_hint(True, "cpu")
    assert preflight.train_precision_hint(False, "cpu") is None and preflight.train_precision_hint(True, "cuda:0") is None
    monkeypatch.setattr(preflight, "cpu_has_bf16_arithmetic", lambda: True)
    assert preflight.precision_hint("bfloat16", "none", "cpu") is None
    assert preflight.train_precision_hint(True, "cpu") is None


def test_option_constants_match_the_engine():
    from verispec.engine import DTYPES
    from verispec.models import DEFAULT_MODEL
    from verispec.options import DEFAULT_MODEL as OPT_DEFAULT_MODEL
    from verispec.options import DTYPE_NAMES

    assert set(DTYPE_NAMES) == set(DTYPES) and OPT_DEFAULT_MODEL == DEFAULT_MODEL


def test_help_shows_defaults():
    rc, out, _ = run("generate", "--help")
    assert rc == 0
    for text in ("(default: 128)", "(default: bfloat16)", "(default: ngram)", "(default: 5)", "(default: 0.0)"):
        assert text in " ".join(out.split()), text


# ---- no torch for --help ----------------------------------------------------------------------

HELP_IMPORTS = """
import sys
from verispec.cli import main
try:
    main({argv!r})
except SystemExit:
    pass
print(sorted(m for m in ("torch", "transformers", "fastapi", "verispec.engine") if m in sys.modules))
"""


# generate, serve and bench list the registered drafters in their help (cli_help), which imports them
@pytest.mark.parametrize("argv", [["--help"], *[[c, "--help"] for c in ("data", "train", "export")]])
def test_help_does_not_import_torch(argv):
    r = subprocess.run([sys.executable, "-c", HELP_IMPORTS.format(argv=argv)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]"


# ---- prompts ----------------------------------------------------------------------------------


def test_a_real_process_exits_with_code_2_and_one_line():
    rc, _, err = cli("generate", "hello", "--threads", "-1")
    assert_user_error(rc, err, "argument --threads: must be >= 1, got -1")
    rc, _, err = cli("generate", "")
    assert_user_error(rc, err, "prompt 1 is empty")


def test_missing_prompt():
    rc, _, err = run("generate")
    assert_user_error(rc, err, "no prompt given")


def test_empty_prompt_is_refused():
    rc, _, err = run("generate", "")
    assert_user_error(rc, err, "prompt 1 is empty")
    rc, _, err = run("generate", "def f(x):", "")
    assert_user_error(rc, err, "prompt 2 is empty")


def test_empty_prompt_in_a_jsonl_file_is_refused(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "def f(x):"}\n{"prompt": ""}\n')
    rc, _, err = run("generate", "--prompts-file", str(f))
    assert_user_error(rc, err, "prompt 2 is empty")


@pytest.mark.parametrize(
    "name,content,needle",
    [
        ("p.jsonl", '{"prompt": "a"}\n{"prompt": \n', "p.jsonl:2: not valid JSON"),
        ("p.jsonl", '{"text": "a"}\n', 'p.jsonl:1: expected an object with a "prompt" string'),
        ("p.jsonl", '["a"]\n', 'p.jsonl:1: expected an object with a "prompt" string'),
        ("p.jsonl", '{"prompt": 3}\n', 'p.jsonl:1: expected an object with a "prompt" string'),
        ("p.txt", b"\xff\xfe\x00bad", "cannot read --prompts-file"),
    ],
)
def test_bad_prompts_file(tmp_path, name, content, needle):
    f = tmp_path / name
    f.write_bytes(content if isinstance(content, bytes) else content.encode())
    rc, _, err = run("generate", "--prompts-file", str(f))
    assert_user_error(rc, err, needle)


def test_prompts_file_that_is_a_directory(tmp_path):
    rc, _, err = run("generate", "--prompts-file", str(tmp_path))
    assert_user_error(rc, err, "is a directory, not a file")


def test_prompts_file_not_found(tmp_path):
    rc, _, err = run("generate", "--prompts-file", str(tmp_path / "nope.txt"))
    assert_user_error(rc, err, "prompts file not found")


def test_prompts_file_lines(tmp_path):
    from argparse import Namespace

    from verispec.cli import read_prompts

    txt = tmp_path / "p.txt"
    txt.write_text("first prompt\n\n  second {not json}\n")
    jl = tmp_path / "p.jsonl"
    jl.write_text('{"prompt": "a\\nb"}\n\n{"prompt": "c", "id": 2}\n')
    assert read_prompts(Namespace(prompts=["x"], prompts_file=str(txt))) == ["x", "first prompt", "  second {not json}"]
    assert read_prompts(Namespace(prompts=[], prompts_file=str(jl))) == ["a\nb", "c"]


# ---- the model: refused before its weights load ------------------------------------------------


def test_unknown_model_path(tmp_path):
    rc, _, err = run("generate", "hello", "--model", str(tmp_path / "nope"))
    assert_user_error(rc, err, "model path not found")


def test_folder_without_config(tmp_path):
    rc, _, err = run("generate", "hello", "--model", str(tmp_path))
    assert_user_error(rc, err, "has no config.json")


def test_unreadable_gguf(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf at all" * 10)
    rc, _, err = run("generate", "hello", "--model", str(bad))
    assert_user_error(rc, err, "is not a GGUF file: it starts with b'not ', not the magic b'GGUF'")
    text = tmp_path / "text.gguf"  # the magic, then text: transformers calls it "GGUF v1869488191"
    text.write_bytes(b"GGUF? no, this is a text file" * 4)
    rc, _, err = run("generate", "hello", "--model", str(text))
    assert_user_error(rc, err, "is followed by b'? no', not a GGUF version (2 or 3)")
    assert "1869488191" not in err
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\x00" * 7)
    rc, _, err = run("generate", "hello", "--model", str(truncated))
    assert_user_error(rc, err, "cannot read GGUF")


def test_fp16_is_refused_for_gemma(tiny):
    """Gemma's activations overflow float16 (every token came out as id 0, and --compare called it
    identical): refused from the config, before the tokenizer or the weights are read."""
    folder = tiny("gemma3", weights=False)
    for dtype in ("float16", "fp16"):
        rc, _, err = run("generate", "w5 w6", "--model", folder, "--dtype", dtype)
        assert_user_error(rc, err, "Gemma models overflow float16")
    rc, _, err = run("serve", "--model", folder, "--dtype", "float16", "--port", "1")
    assert_user_error(rc, err, "Gemma models overflow float16")


def test_fp16_is_refused_for_gemma_in_the_python_api(tiny):
    from verispec.engine import LLM

    with pytest.raises(ValueError, match="Gemma models overflow float16"):
        LLM(tiny("gemma3"), dtype="float16")


def test_fp16_generates_the_fp32_tokens_on_llama(tiny):
    """Where fp16 holds the activations (this Llama), it decodes what fp32 decodes."""
    from verispec.engine import LLM
    from verispec.sampling import SamplingParams

    prompt = "w10 w11 w12 w13 w14 w10 w11"
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    outs = {d: LLM(tiny("llama"), dtype=d, drafter="ngram", max_model_len=64).generate([prompt], sp).outputs[0]
            for d in ("float32", "float16")}
    assert outs["float16"].token_ids == outs["float32"].token_ids
    assert len(set(outs["float16"].token_ids)) > 1  # not one repeated id


def test_max_model_len_beyond_the_context(tiny):
    folder = tiny("llama", weights=False)  # context 256
    rc, _, err = run("generate", "w5", "--model", folder, "--max-model-len", "1000000")
    assert_user_error(rc, err, f"--max-model-len 1000000 exceeds the context of {folder} (256 tokens)")
    rc, _, err = run("serve", "--model", folder, "--max-model-len", "257", "--port", "1")
    assert_user_error(rc, err, "(256 tokens)")


def test_max_model_len_beyond_the_context_in_the_python_api(tiny):
    from verispec.engine import LLM

    with pytest.raises(ValueError, match="exceeds the context"):
        LLM(tiny("llama"), max_model_len=257)
    assert LLM(tiny("llama")).engine.max_len == 256  # the default (2048) is cut to the context


def test_prompt_length_is_checked_before_the_weights_load(tiny):
    """A folder without weights: the length error can only come before the weights are read."""
    folder = tiny("llama", weights=False)
    rc, _, err = run("generate", "w5 " * 60, "--model", folder, "--max-model-len", "64", "--max-tokens", "8")
    assert_user_error(rc, err, "the prompt (61 tokens) + --max-tokens 8 exceeds the context of 64 tokens")
    rc, _, err = run("generate", "w5", "--model", folder, "--max-tokens", "8")
    assert_user_error(rc, err, "has no .safetensors weights")  # a prompt that fits goes on to the weights


def test_generate_on_a_tiny_model(tiny):
    rc, out, err = cli("generate", "w10 w11 w12 w10 w11", "w20 w21", "--model", tiny("llama"), "--max-tokens", "6",
                       "--ignore-eos", "--compare", "--json", "--dtype", "float32", "--threads", "1")
    assert rc == 0, err
    r = json.loads(out)
    assert [len(o["token_ids"]) for o in r["outputs"]] == [6, 6] and r["threads"] == 1
    assert r["baseline"]["outputs_identical"] == [True, True]


@pytest.mark.real_model
def test_prompt_longer_than_context():
    rc, _, err = cli("generate", "word " * 100, "--max-model-len", "64", "--max-tokens", "8")
    assert_user_error(rc, err, "exceeds the context of 64 tokens")


@pytest.mark.real_model
def test_fp16_is_refused_for_the_default_model():
    rc, _, err = cli("generate", "def f(x):", "--dtype", "float16", "--compare")
    assert_user_error(rc, err, "Gemma models overflow float16")


@pytest.mark.real_model
def test_json_output_with_compare():
    rc, out, err = cli("generate", "def add(a, b):", "--max-tokens", "12", "--ignore-eos", "--compare", "--json",
                       "--dtype", "float32")
    assert rc == 0, err
    r = json.loads(out)
    o = r["outputs"][0]
    assert len(o["token_ids"]) == 12 and isinstance(o["text"], str)
    assert r["baseline"]["outputs_identical"] == [True]
    s, b = r["stats"], r["baseline"]
    assert s["tokens"] == b["tokens"] == 12
    assert s["tokens_per_second"] == pytest.approx(s["tokens"] / s["seconds"], rel=0.01)
    assert r["speedup"] == pytest.approx(s["tokens_per_second"] / b["tokens_per_second"], rel=0.01)
    assert s["target_forwards"] * s["tau"] == pytest.approx(11, abs=0.01)  # tokens after the prefill's first
    for key in ("acceptance_rate", "acceptance_per_position_conditional"):
        assert key in s


def test_conversion_is_announced_as_information(tmp_path, monkeypatch):
    """A first-use GGUF conversion prints `verispec: converting ...`, not a WARNING."""
    import logging

    import transformers

    from verispec import cli
    from verispec.models import ModelLoadError
    from verispec.models.loading import _convert_gguf

    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 32)

    def stop(*a, **k):
        raise OSError("stop here")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", stop)
    cli._setup_logging()  # what `verispec` does first
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("verispec").addHandler(handler)
    try:
        with pytest.raises(ModelLoadError, match="stop here"):
            _convert_gguf(f, tmp_path / "out")
    finally:
        logging.getLogger("verispec").removeHandler(handler)
    (r,) = [r for r in records if "converting" in r.getMessage()]
    assert r.levelno == logging.INFO and "m.gguf" in r.getMessage()
    info = [h for h in logging.getLogger("verispec").handlers if getattr(h, "verispec_info", False)]
    assert len(info) == 1 and info[0].format(r).startswith("verispec: converting m.gguf")
