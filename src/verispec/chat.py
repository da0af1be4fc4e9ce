"""Chat messages -> prompt token ids, and the tokens that end the model's turn.

The one home of chat formatting: the server's /v1/chat/completions, `verispec bench` and
`verispec data` all call `encode_chat`, so a conversation becomes the same token ids everywhere.

Formats, in order: the tokenizer's chat template; the Gemma turn format written out for Gemma
base checkpoints (they ship without a template); a plain "role: content" fallback.

BOS: the prompt starts with exactly one BOS when the tokenizer adds one to plain text (Gemma,
Llama) or the template writes one, and with none otherwise (Qwen). Templates that write BOS as text
and tokenizers that add it again are the usual source of a doubled BOS; here the text is tokenized
without special tokens and BOS is added once, by `with_bos`.
"""

from __future__ import annotations

import json
from pathlib import Path

GEMMA_TURN = "<start_of_turn>{role}\n{text}<end_of_turn>\n"
GEMMA_TURN_END = "<end_of_turn>"
# The same Gemma turn format as a chat template, written into converted Gemma folders that come
# without one, so that transformers and vLLM render a conversation as `render_chat` does (system
# turns as user turns, one BOS; tests/test_checkpoint.py checks the ids are the same).
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else 'user') + '\\n' + m['content'] + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)


def render_chat(tokenizer, model_type: str | None, messages: list[dict]) -> str:
    """Prompt text for `messages` ([{"role": ..., "content": ...}]) ending where the model answers.
    Any BOS the chat template writes stays in the text; `encode_chat` makes sure there is one."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if _is_gemma(model_type):
        return "".join(GEMMA_TURN.format(role="model" if m["role"] == "assistant" else "user", text=m["content"])
                       for m in messages) + "<start_of_turn>model\n"  # Gemma folds system into user
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


def encode_chat(tokenizer, model_type: str | None, messages: list[dict]) -> list[int]:
    """Token ids of the chat prompt, with exactly one leading BOS when the model uses one."""
    text = render_chat(tokenizer, model_type, messages)
    return with_bos(tokenizer, list(tokenizer(text, add_special_tokens=False).input_ids))


def with_bos(tokenizer, ids: list[int]) -> list[int]:
    """ids with one BOS in front if the tokenizer adds BOS to plain text and ids lack it."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None or (ids and ids[0] == bos) or not adds_bos(tokenizer):
        return ids
    return [bos, *ids]


def adds_bos(tokenizer) -> bool:
    """Whether the tokenizer puts BOS in front of plain text (probed: tokenizers say it differently)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    ids = tokenizer("a").input_ids
    return bool(ids) and ids[0] == bos


def turn_end_ids(tokenizer, model_type: str | None, model_dir: str | Path | None = None) -> tuple[int, ...]:
    """Token ids that end the model's turn in a chat, beyond the model's EOS: the token the chat
    template writes after an assistant message (`<end_of_turn>` for Gemma, `<|im_end|>` for
    Qwen, `<|eot_id|>` for Llama 3), and the EOS ids of the model's generation_config.json."""
    ids: list[int] = []
    marker = _template_turn_end(tokenizer)
    if marker is not None:
        ids.append(marker)
    elif _is_gemma(model_type) and GEMMA_TURN_END in tokenizer.get_vocab():
        ids.append(tokenizer.convert_tokens_to_ids(GEMMA_TURN_END))
    if model_dir is not None:
        ids += _generation_eos(Path(model_dir))
    return tuple(dict.fromkeys(ids))


def _template_turn_end(tokenizer) -> int | None:
    """The special token the chat template puts right after an assistant message's content."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    content = "Xq7Zk"
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": content}],
                                             tokenize=False)
    except Exception:  # noqa: BLE001 - a template that cannot render this pair: no marker known
        return None
    i = text.rfind(content)
    if i < 0:
        return None
    after = tokenizer(text[i + len(content):], add_special_tokens=False).input_ids
    special = set(tokenizer.all_special_ids) | {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()
                                               if getattr(t, "special", False)}
    return after[0] if after and after[0] in special else None


def _generation_eos(folder: Path) -> list[int]:
    f = folder / "generation_config.json"
    try:
        eos = json.loads(f.read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return []
    eos = eos if isinstance(eos, list) else [eos]
    return [int(e) for e in eos if isinstance(e, int)]


def _is_gemma(model_type: str | None) -> bool:
    return bool(model_type) and model_type.startswith("gemma")
