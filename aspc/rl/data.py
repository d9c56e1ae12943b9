"""Prompts for training steps: a built-in synthetic task, or a JSONL file.

JSONL schema, one object per line: {"prompt": str (required), "answer": str (optional),
"metadata": object (optional)}. A bad row is an error naming the file and line.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from aspc.rl.tasks import example
from aspc.rl.tokenizer import CHARS


class DataError(Exception):
    """A data file a user gave cannot be used (message: file, line, what to do)."""


@dataclass(frozen=True)
class Prompt:
    text: str
    ids: list[int]
    answer: str | None
    metadata: dict = field(default_factory=dict)


HELD_OUT = 2 * 10**7  # the first held-out prompt's index: far from every run's and warm start's
HELD_OUT_SHARE, HELD_OUT_MOST = 4, 128  # a JSONL file holds out one row in 4 (at most 128) from training


class PromptSource:
    """Prompt i of the run: a seeded task example, or row i of the file's training rows (reshuffled
    each epoch), as token ids of the model's tokenizer (a checkpoint's: the text in its chat
    template). Indices from HELD_OUT on are held-out prompts: task examples no run draws, or a JSONL
    file's held-out rows (one in HELD_OUT_SHARE, at most HELD_OUT_MOST, the same rows for every data
    seed), which no step trains on."""

    def __init__(self, source: str, location: str, seed: int, max_response: int, base_dir: Path | None,
                 tokenizer=CHARS):
        self.source, self.location, self.seed, self.max_response = source, location, seed, max_response
        self.tokenizer = tokenizer
        self.rows: list[tuple[int, dict]] | None = None
        self.held_rows: list[tuple[int, dict]] = []
        if source == "jsonl":
            self.rows, self.held_rows = _hold_out(_read_jsonl(base_dir / location if base_dir else Path(location)))

    def held_out_count(self, wanted: int) -> int:
        """How many of the `wanted` held-out prompts are distinct (all, for a task or a file too
        small to hold rows out)."""
        return min(wanted, len(self.held_rows)) if self.held_rows else wanted

    def __call__(self, index: int) -> Prompt:
        if self.rows is None:
            ex = example(self.location, self.seed, index, self.max_response)
            return Prompt(ex.prompt, self.tokenizer.prompt_ids(ex.prompt), ex.answer)
        if index >= HELD_OUT and self.held_rows:
            return self._prompt(*self.held_rows[(index - HELD_OUT) % len(self.held_rows)])
        epoch, offset = divmod(index, len(self.rows))
        order = list(range(len(self.rows)))
        random.Random(f"{self.seed}/{epoch}").shuffle(order)
        return self._prompt(*self.rows[order[offset]])

    def _prompt(self, line: int, row: dict) -> Prompt:
        return Prompt(row["prompt"], self._encode(row["prompt"], line), row.get("answer"),
                      row.get("metadata") or {})

    def _encode(self, text: str, line: int) -> list[int]:
        try:
            return self.tokenizer.prompt_ids(text)
        except ValueError as error:
            raise DataError(f"{self.location}:{line}: {error}; the CPU backend's tokenizer covers the built-in "
                            "tasks only") from None


def _hold_out(rows: list[tuple[int, dict]]) -> tuple[list[tuple[int, dict]], list[tuple[int, dict]]]:
    """(training rows, held-out rows): one row in HELD_OUT_SHARE, at most HELD_OUT_MOST, chosen by a
    fixed shuffle (not the data seed: runs of every seed measure the same prompts). A file of
    fewer than HELD_OUT_SHARE rows holds none out: its rows are all it has to train on, and its
    held-out evaluation reads them too (docs/runtime.md says so)."""
    count = min(HELD_OUT_MOST, len(rows) // HELD_OUT_SHARE)
    if count == 0:
        return rows, []
    order = list(range(len(rows)))
    random.Random("aspc held-out rows").shuffle(order)
    held = set(order[:count])
    return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]


def json_objects(path: Path, what: str) -> list[tuple[int, dict]]:
    """(line number, object) of each non-blank line of a JSONL file; a file that cannot be read, or
    a line that is not a JSON object, is a DataError naming the file and line."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise DataError(f"{path}: cannot read the {what}: {error.strerror}") from None
    except UnicodeDecodeError:
        raise DataError(f"{path}: not UTF-8 text") from None
    rows = []
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            row = json.loads(text)
        except json.JSONDecodeError as error:
            raise DataError(f"{path}:{number}: not valid JSON ({error.msg})") from None
        if not isinstance(row, dict):
            raise DataError(f"{path}:{number}: each line must be a JSON object")
        rows.append((number, row))
    return rows


def _read_jsonl(path: Path) -> list[tuple[int, dict]]:
    rows = json_objects(path, "data file")
    for number, row in rows:
        if not isinstance(row.get("prompt"), str):
            raise DataError(f'{path}:{number}: each line needs a string "prompt" field')
        if "answer" in row and not isinstance(row["answer"], str):
            raise DataError(f'{path}:{number}: "answer" must be a string')
        if "metadata" in row and not isinstance(row["metadata"], dict):
            raise DataError(f'{path}:{number}: "metadata" must be an object')
    if not rows:
        raise DataError(f"{path}: the file has no rows")
    return rows
