"""Chat formatting in one place (chat.py): the server, `verispec bench` and `verispec data` encode a
conversation to the same ids, with exactly one BOS whatever the format; and the turn-end tokens."""

from __future__ import annotations

import pytest

from conftest import char_tokenizer
from verispec import prompts as P
from verispec.chat import encode_chat, render_chat, turn_end_ids
from verispec.train.data import encode_prompt

CHATML = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHATML_NO_BOS = CHATML.removeprefix("{{ bos_token }}")
MSGS = [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "More."}]

# (tokenizer adds BOS to plain text, chat template, model type)
CASES = [(True, None, "gemma3_text"), (True, CHATML, "llama"), (True, CHATML_NO_BOS, "llama"),
         (False, CHATML, "qwen2"), (False, CHATML_NO_BOS, "qwen2"), (True, None, "llama"), (False, None, "qwen2")]


@pytest.mark.parametrize("adds_bos,template,model_type", CASES)
def test_one_bos_and_the_same_ids_from_every_caller(adds_bos, template, model_type):
    tok = char_tokenizer(add_bos=adds_bos, chat_template=template)
    ids = encode_chat(tok, model_type, MSGS)
    bos = tok.bos_token_id
    # exactly one BOS when the tokenizer or the template wants one; none otherwise
    wants_bos = adds_bos or (template is not None and template.startswith("{{ bos_token }}"))
    assert ids.count(bos) == int(wants_bos) and (ids[0] == bos) == wants_bos
    assert tok.decode(ids, skip_special_tokens=False).removeprefix("<bos>") == \
        render_chat(tok, model_type, MSGS).removeprefix("<bos>")
    # the benchmark's prompts and the training data's prompts are the same ids
    p = P.Prompt("mtbench", "mtbench/1#2", "writing", "chat", ["Hi?", "More."], answers=["Hello."])
    assert P.render(p, tok, model_type) == ids
    assert encode_prompt(tok, model_type, {"messages": MSGS}) == ids


def test_gemma_format_without_a_template():
    tok = char_tokenizer()
    assert render_chat(tok, "gemma3_text", MSGS[:1] + [{"role": "system", "content": "Be brief."}]) == \
        "<start_of_turn>user\nHi?<end_of_turn>\n<start_of_turn>user\nBe brief.<end_of_turn>\n<start_of_turn>model\n"


def test_turn_end_tokens(tmp_path):
    gemma = char_tokenizer()
    assert turn_end_ids(gemma, "gemma3_text") == (gemma.convert_tokens_to_ids("<end_of_turn>"),)
    chatml = char_tokenizer(chat_template=CHATML)
    assert turn_end_ids(chatml, "llama") == (chatml.convert_tokens_to_ids("<|im_end|>"),)
    assert turn_end_ids(char_tokenizer(), "llama") == ()  # plain "role: text" format: EOS only
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 7]}')
    assert turn_end_ids(gemma, "gemma3_text", tmp_path) == (5, 2, 7)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 9}')
    assert turn_end_ids(chatml, "llama", tmp_path) == (7, 9)
    (tmp_path / "generation_config.json").write_text("not json")
    assert turn_end_ids(chatml, "llama", tmp_path) == (7,)
