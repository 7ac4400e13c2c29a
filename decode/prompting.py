"""Prompt text -> token ids as the model expects them: chat template, BOS, truncation that keeps both.

Every stage (labelling, decoding, the bench, the Hugging Face baselines) encodes prompts here, so a head
is trained on the same token sequences it later decodes after.
"""

from __future__ import annotations


def render(tokenizer, text: str, chat_template: bool) -> list[int]:
    """The whole prompt: the text as one user turn of the chat template with the assistant's header after it,
    or the plain text with the special tokens the tokenizer adds itself (Llama's BOS; GPT-2 adds none)."""
    if chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the pair config sets chat_template: true but the tokenizer has no chat template: "
                             "set chat_template: false, or use the instruct checkpoint's tokenizer")
        templated = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  tokenize=False)
        # The template writes its own BOS where the model wants one; do not let the tokenizer add a second.
        return tokenizer(templated, add_special_tokens=False, verbose=False)["input_ids"]
    # verbose=False: a prompt longer than the model's context is cut by encode(), so the tokenizer's own warning
    # about it ("Token indices sequence length is longer ...") would be noise
    return tokenizer(text, add_special_tokens=True, verbose=False)["input_ids"]


def frame(tokenizer, chat_template: bool) -> tuple[list[int], list[int]]:
    """(head, tail): the ids every prompt starts and ends with (BOS, the template's header and footer),
    found as what the prompt of an empty text shares with a prompt of a long text."""
    empty, full = render(tokenizer, "", chat_template), render(tokenizer, "x" * 64, chat_template)
    n_head = 0
    while n_head < min(len(empty), len(full)) and empty[n_head] == full[n_head]:
        n_head += 1
    n_tail = 0
    while n_tail < min(len(empty), len(full)) - n_head and empty[-1 - n_tail] == full[-1 - n_tail]:
        n_tail += 1
    return empty[:n_head], empty[len(empty) - n_tail:] if n_tail else []


def encode(tokenizer, text: str, chat_template: bool = False, max_tokens: int | None = None) -> list[int]:
    """Prompt text -> ids; over max_tokens, the text's oldest tokens go and the BOS and template stay.

    An empty or blank text gives [] (callers refuse or skip it) even where a template would frame it.
    """
    if not text.strip():
        return []
    ids = render(tokenizer, text, chat_template)
    if max_tokens is None or len(ids) <= max_tokens:
        return ids
    head, tail = frame(tokenizer, chat_template)
    room = max_tokens - len(head) - len(tail)
    if room < 1:
        raise ValueError(f"a prompt budget of {max_tokens} tokens leaves no room for text after the "
                         f"{len(head) + len(tail)} tokens of BOS and chat template: raise max_context")
    body = ids[len(head): len(ids) - len(tail)]
    return head + body[-room:] + tail
