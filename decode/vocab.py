"""Do the draft and target share one tokenizer? check_vocabularies refuses, in one line, a pair whose token ids
mean other text, before any model loads: speculative decoding compares p and q id by id.

    check_vocabularies(draft_tokenizer, target_tokenizer) -> V
"""

from __future__ import annotations

# Compared token by token between the two tokenizers: code, prose, digits, unicode, spaces.
PROBE = "def f(x):\n    return x ** 2  # héllo, wörld 12345 \t{[()]}"


class VocabularyMismatch(ValueError):
    """The draft and target do not share token ids, so p and q cannot be compared."""


def byte_letters() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's bytes_to_unicode), letter -> byte: printable bytes stand for themselves, the
    others for the letters from U+0100 on, in byte order."""
    keep = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    letters, extra = {}, 0
    for b in range(256):
        if b in keep:
            letters[chr(b)] = b
        else:
            letters[chr(256 + extra)] = b
            extra += 1
    return letters


BYTE_OF = byte_letters()


def token_bytes(token: str) -> bytes:
    """A vocabulary entry's bytes however its tokenizer spells it: <0xNN> one byte, a byte-level BPE entry (every
    letter in BYTE_OF) the bytes its letters stand for, any other the UTF-8 of its text. Transformers respells a GGUF's
    tokens in byte-level letters (DeepSeek's control tokens, added tokens written as text) where the file holds their
    text."""
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        try:
            return bytes([int(token[3:5], 16)])
        except ValueError:
            pass
    if token and all(c in BYTE_OF for c in token):
        return bytes(BYTE_OF[c] for c in token)
    return token.encode("utf-8")


def check_vocabularies(draft_tok, target_tok) -> int:
    """Shared vocabulary size V, or VocabularyMismatch naming what differs: the sizes, the ids whose entries hold other
    bytes (a whole-vocabulary comparison: two tokens trading ids anywhere), or the probe text's encodings (one
    vocabulary, other normalisation or merges)."""
    nd, nt = len(draft_tok), len(target_tok)
    if nd != nt:
        raise VocabularyMismatch(
            f"draft vocabulary has {nd} tokens, target vocabulary has {nt}: speculative decoding needs "
            "one shared tokenizer. Pick a draft from the target's model family."
        )
    spelled_d = {i: t for t, i in draft_tok.get_vocab().items()}
    spelled_t = {i: t for t, i in target_tok.get_vocab().items()}
    differ = [i for i in sorted(spelled_d.keys() | spelled_t.keys()) if spelled_d.get(i) != spelled_t.get(i)
              and (i not in spelled_d or i not in spelled_t or token_bytes(spelled_d[i]) != token_bytes(spelled_t[i]))]
    if differ:
        shown = ", ".join(f"id {i} is {spelled_d.get(i)!r} in the draft, {spelled_t.get(i)!r} in the target"
                          for i in differ[:3])
        raise VocabularyMismatch(
            f"draft and target have {nd} tokens each but {len(differ)} "
            f"{'ids stand' if len(differ) > 1 else 'id stands'} for other bytes ({shown}): they are different "
            "tokenizers. Pick a draft from the target's model family."
        )
    ids_d, ids_t = draft_tok.encode(PROBE), target_tok.encode(PROBE)
    if ids_d != ids_t:
        raise VocabularyMismatch(
            f"draft and target have {nd} tokens each but tokenize {PROBE!r} differently "
            f"({ids_d[:8]}... vs {ids_t[:8]}...): they are different tokenizers."
        )
    return nt
