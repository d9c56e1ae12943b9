"""A character tokenizer for the built-in tasks: digits, a few operators, the brackets of the
compact tool-call format, and three specials."""
from __future__ import annotations

PAD, BOS, EOS = 0, 1, 2
SYMBOLS = "0123456789+-*=#c:[]()"  # appended only: ids stay fixed, so shipped checkpoints keep their meaning
VOCAB_SIZE = 3 + len(SYMBOLS)  # 24; models may declare a larger vocab (unused rows)
_ID = {ch: i + 3 for i, ch in enumerate(SYMBOLS)}


class TokenizeError(ValueError):
    """Text holds a character the task vocabulary does not have."""


def encode(text: str) -> list[int]:
    try:
        return [_ID[ch] for ch in text]
    except KeyError as error:
        raise TokenizeError(f"character {error.args[0]!r} is not in the task vocabulary "
                            f"({SYMBOLS!r})") from None


def decode(ids) -> str:
    out = []
    for i in ids:
        i = int(i)
        if i == EOS:
            break
        if i >= 3 and i - 3 < len(SYMBOLS):
            out.append(SYMBOLS[i - 3])
    return "".join(out)


class CharTokenizer:
    """The character tokenizer behind the interface that a checkpoint's tokenizer also has
    (hf_tokenizer.py): what data, generation, rewards and the warm start use."""

    eos = EOS  # what a supervised example ends with
    eos_ids = frozenset({EOS})  # what ends a generated response
    chat_template = None

    def encode(self, text: str) -> list[int]:
        return encode(text)

    def decode(self, ids) -> str:
        return decode(ids)

    def prompt_ids(self, text: str) -> list[int]:
        return [BOS] + encode(text)


CHARS = CharTokenizer()
