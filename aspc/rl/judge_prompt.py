"""A checkpoint judge's prompt and verdict in its own tokenizer (hf_tokenizer.HfTokenizer), for
judges that do not read the task's character vocabulary (judge.CharPrompt).

The judge reads one user message of its chat template, with the generation prompt: the rubric,
then the problem (the rollout's prompt text) and the response (the policy's response tokens
decoded by the policy's tokenizer, so that judge and policy need not share a vocabulary). Its
verdict is the first token it writes, read as the CPU judge reads it: the judge tokenizer's own
tokens for "1" and "0". An input longer than the judge's max_seq loses the end of the response,
as the character prompt does (one whose rubric and problem alone are longer is cut at max_seq)."""
from __future__ import annotations

VERDICTS = ("1", "0")


class JudgePromptError(ValueError):
    """The judge's tokenizer cannot hold the verdict (message: which tokenizer, what to do)."""


def verdict_token(tokenizer, text: str) -> int:
    """The one token `text` is in the judge's tokenizer."""
    ids = tokenizer.encode(text)
    if len(ids) != 1:
        raise JudgePromptError(f"the judge's tokenizer writes the verdict \"{text}\" as {len(ids)} tokens {ids}; "
                               "the judge reads a one-token verdict: use a judge whose tokenizer has one token for "
                               "each digit")
    return ids[0]


def judge_message(rubric: str, problem: str, response: str) -> str:
    parts = [rubric] if rubric else []
    return "\n\n".join(parts + [f"Problem: {problem}", f"Response: {response}"])


class TokenizerPrompt:
    """`build(item)`: the judge's input ids for an item with .prompt_text and .response (policy token
    ids); `yes`, `no`: the verdict tokens."""

    def __init__(self, judge_tokenizer, policy_tokenizer, rubric: str, max_seq: int):
        self.judge, self.policy, self.rubric, self.max_seq = judge_tokenizer, policy_tokenizer, rubric, max_seq
        self.yes, self.no = (verdict_token(judge_tokenizer, text) for text in VERDICTS)

    def build(self, item) -> list[int]:
        response = self.policy.decode(item.response)
        ids = self._ids(item.prompt_text, response)
        kept = self.judge.encode(response)
        while len(ids) > self.max_seq and kept:  # re-tokenised text may merge at the cut: cut again
            kept = kept[:max(0, len(kept) - (len(ids) - self.max_seq))]
            ids = self._ids(item.prompt_text, self.judge.inner.decode(kept))
        return ids[:self.max_seq] if len(ids) > self.max_seq else ids

    def _ids(self, problem: str, response: str) -> list[int]:
        return self.judge.prompt_ids(judge_message(self.rubric, problem, response))
