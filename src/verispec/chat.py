"""Chat messages -> prompt text: the tokenizer's chat template, or the Gemma turn format for
Gemma base checkpoints (which ship without a template), or a plain fallback."""

from __future__ import annotations


def format_chat(tokenizer, model_type: str, messages: list[dict]) -> str:
    """Prompt text for `messages` ([{"role": ..., "content": ...}]) ending where the model answers."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if model_type.startswith("gemma"):
        parts = []
        for m in messages:
            role = "model" if m["role"] == "assistant" else "user"  # Gemma folds system into user
            parts.append(f"<start_of_turn>{role}\n{m['content']}<end_of_turn>\n")
        return "".join(parts) + "<start_of_turn>model\n"
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
