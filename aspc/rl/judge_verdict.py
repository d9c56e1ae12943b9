"""An LLM judge's prompt and its reading of the verdict, engine-free: the judge reads
`BOS + rubric + prompt + response + "#"` (CharPrompt, in the task's character vocabulary; a checkpoint
judge's chat template: judge_prompt.py) and answers "1" (right) or "0" (wrong). How its score is read
is the judge(...) source's `read` option:

- "probability" (the default): P("1") / (P("1") + P("0")) at the verdict position;
- "verdict": the greedy answer parsed: "1" scores 1.0, "0" scores 0.0, and any other token is a
  failed call (JudgeCallFailed), which the run's failure policy handles (docs/runtime.md).

Where the logits at the verdict position come from is an engine's (`verdict_logits`): a CPU forward
pass (backends/cpu/judge.py) or a vLLM engine's log-probs (backends/ascend/judge.py)."""
from __future__ import annotations

import torch

from aspc.rl.tokenizer import BOS, EOS, encode

SEPARATOR = encode("#")
YES, NO = encode("1")[0], encode("0")[0]
READS = ("probability", "verdict")


class JudgeCallFailed(Exception):
    """The judge's answer is not a verdict (read = "verdict")."""


def judge_input(rubric: list[int], prompt: list[int], response: list[int], max_seq: int) -> list[int]:
    """BOS + rubric + prompt + response (without EOS), cut to leave room for the separator."""
    body = [t for t in prompt if t != BOS] + [t for t in response if t != EOS]
    ids = [BOS] + rubric + body
    return ids[:max_seq - len(SEPARATOR)] + SEPARATOR


class CharPrompt:
    """A tiny judge's prompt and verdict in the task's character vocabulary (`judge_input`; the
    verdict tokens "1" and "0"): the policy's own token ids, read as they are."""

    def __init__(self, rubric: str, max_seq: int):
        self.rubric, self.max_seq, self.yes, self.no = encode(rubric), max_seq, YES, NO

    def build(self, item) -> list[int]:
        return judge_input(self.rubric, item.prompt, item.response, self.max_seq)


class VerdictJudge:
    """One judge(...) source on one instance: a score per (prompt, response) token sequence. `prompt`
    builds each input and names the verdict tokens: the character vocabulary's (CharPrompt) unless
    given (a checkpoint judge's own tokenizer: judge_prompt.TokenizerPrompt). `model`: the engine's
    judge model (.eval(), .arch.max_seq); an engine's subclass gives `verdict_logits`."""

    def __init__(self, model, rubric: str = "", read: str = "probability", prompt=None):
        self.model, self.read = model.eval(), read
        self.prompt = prompt or CharPrompt(rubric, model.arch.max_seq)
        self.source = "judge"  # how messages name it: a reward stage sets judge(NAME)

    @torch.no_grad()
    def scores(self, rollouts: list) -> list[float]:
        logits = self.verdict_logits([self.prompt.build(r) for r in rollouts])
        yes, no = self.prompt.yes, self.prompt.no
        if self.read == "probability":
            return torch.softmax(logits[:, [no, yes]], -1)[:, 1].tolist()
        answers = logits.argmax(-1).tolist()
        if any(a not in (yes, no) for a in answers):
            raise JudgeCallFailed(f"the judge answered token {next(a for a in answers if a not in (yes, no))}, "
                                  'not a verdict ("1" or "0")')
        return [float(a == yes) for a in answers]

    def verdict_logits(self, inputs: list[list[int]]) -> torch.Tensor:
        """[B, V] logits at each input's verdict position."""
        raise NotImplementedError
