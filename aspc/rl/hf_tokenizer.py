"""A Hugging Face checkpoint's tokenizer (tokenizer.json, tokenizer_config.json and its chat
template) behind the interface of the character tokenizer (tokenizer.CharTokenizer). A prompt is
the user's message in the chat template with the generation prompt (the checkpoint's own BOS
handling when it has no template); a response ends at any of the checkpoint's end-of-sequence ids
(the tokenizer's, config.json's and generation_config.json's)."""
from __future__ import annotations

import json
from pathlib import Path


class HfError(ValueError):
    """A checkpoint directory's tokenizer or weights cannot be used (message: which, why, what to do)."""


class HfTokenizer:
    def __init__(self, directory: Path):
        try:
            from transformers import AutoTokenizer

            self.inner = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        except ImportError:
            raise HfError("hf(...) models need the transformers package: pip install transformers") from None
        except (OSError, ValueError) as error:
            raise HfError(f"{directory}: cannot load the tokenizer: {str(error).splitlines()[0]}") from None
        self.chat_template = self.inner.chat_template
        self.eos_ids = frozenset(_eos_ids(directory, self.inner.eos_token_id))
        if not self.eos_ids:
            raise HfError(f"{directory}: neither the tokenizer nor config.json names an end-of-sequence token")
        self.eos = self.inner.eos_token_id if self.inner.eos_token_id is not None else min(self.eos_ids)

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text, add_special_tokens=False)

    def decode(self, ids) -> str:
        """The text up to the first end-of-sequence id, without special tokens."""
        ids = [int(i) for i in ids]
        end = next((n for n, i in enumerate(ids) if i in self.eos_ids), len(ids))
        text = self.inner.decode(ids[:end], skip_special_tokens=True)
        assert isinstance(text, str), "one sequence of ids decodes to one string"
        return text

    def prompt_ids(self, text: str) -> list[int]:
        if not self.chat_template:
            return self.inner.encode(text)
        rendered = self.inner.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                  add_generation_prompt=True)
        assert isinstance(rendered, str), "tokenize=False renders text"
        return self.encode(rendered)


def _eos_ids(directory: Path, tokenizer_eos: int | None) -> set[int]:
    ids = {tokenizer_eos} if tokenizer_eos is not None else set()
    for name in ("config.json", "generation_config.json"):
        try:
            value = json.loads((directory / name).read_text(encoding="utf-8")).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        ids |= set(value) if isinstance(value, list) else {value} if isinstance(value, int) else set()
    return ids
