"""An LLM judge on the CPU (RLAIF): a small generative TinyQwen asked whether a response is right.

The judge reads `BOS + rubric + prompt + response + "#"` and answers with one token, "1" (right)
or "0" (wrong). How its score is read is the judge(...) source's `read` option:

- "probability" (the default): P("1") / (P("1") + P("0")) at the verdict position, a number in
  [0, 1] that keeps the judge's confidence (as judges read from token log-probs do);
- "verdict": the greedy answer parsed: "1" scores 1.0, "0" scores 0.0, and any other token is a
  failed call (JudgeCallFailed), which the run's failure policy handles (docs/runtime.md).

A judge starts as the supervised model does (next-token training on right answers) and is then
warm-started to judge on verifier-labelled answers from a preference file (each pair gives a right
answer, labelled "1", and a wrong one, labelled "0"), with the next-token loss kept so it does not
forget the task: `aspc train-judge`, which reports its agreement with the verifier on held-out
answers it never trained on. A tiny judge reads only the task vocabulary, rubric included.
"""
from __future__ import annotations

import random
import time
from pathlib import Path

import torch

from aspc.backends.cpu.batching import make_batch, token_logprobs
from aspc.rl.data import DataError
from aspc.backends.cpu.model import TinyQwen
from aspc.backends.cpu.reward_model import (Pair, RewardModelError, load_weights, read_pairs, save_weights, split,
                                            tiny_model)
from aspc.rl.judge_verdict import NO, YES, VerdictJudge, judge_input
from aspc.rl.tokenizer import encode
from aspc.ir.facts import ModelArch

TRAIN_HINT = "warm-start one with `aspc train-judge FILE.aspl --model NAME --data prefs.jsonl -o PATH`"


def verdict_logits(model: TinyQwen, inputs: list[list[int]]) -> torch.Tensor:
    """[B, V] next-token logits after each input's separator."""
    batch = make_batch([(ids, []) for ids in inputs])
    logits = model(batch.tokens, batch.positions, batch.mask)
    last = torch.tensor([len(ids) - 1 for ids in inputs])
    return logits[torch.arange(len(inputs)), last].float()


class CpuJudge(VerdictJudge):
    """A judge(...) source on the CPU: the verdict reading of aspc/rl/judge_verdict.py over a TinyQwen's
    logits."""

    def verdict_logits(self, inputs: list[list[int]]) -> torch.Tensor:
        """[B, V] logits at each input's verdict position (the NPU judge reads them from vLLM)."""
        return verdict_logits(self.model, inputs)


# ---- warm-starting a judge on verifier labels ----
def _labelled(pairs: list[Pair]) -> list[tuple[list[int], list[int], int]]:
    return [(p.prompt, p.chosen, 1) for p in pairs] + [(p.prompt, p.rejected, 0) for p in pairs]


def verdict_loss(model: TinyQwen, rubric: list[int], items) -> torch.Tensor:
    inputs = [judge_input(rubric, prompt, response, model.arch.max_seq) for prompt, response, _ in items]
    logits = verdict_logits(model, inputs)  # over the whole vocabulary: a verdict is what it writes
    return torch.nn.functional.cross_entropy(logits, torch.tensor([YES if label else NO for _, _, label in items]))


def answer_loss(model: TinyQwen, pairs: list[Pair]) -> torch.Tensor:
    """Next-token loss of the right answers (prompt -> chosen)."""
    batch = make_batch([(p.prompt, p.chosen) for p in pairs])
    logp, _ = token_logprobs(model, batch)
    mask = batch.response_mask()
    return -(logp * mask).sum() / mask.sum()


@torch.no_grad()
def agreement(judge: CpuJudge, pairs: list[Pair]) -> float:
    """Fraction of held-out answers (each pair's right and wrong one) the judge labels as the
    verifier does (score above one half: right)."""
    items = _labelled(pairs)
    rollouts = [_Text(prompt, response) for prompt, response, _ in items]
    scores = [s for i in range(0, len(rollouts), 256) for s in judge.scores(rollouts[i:i + 256])]
    return sum((s > 0.5) == bool(label) for s, (_, _, label) in zip(scores, items)) / len(items)


class _Text:
    def __init__(self, prompt, response):
        self.prompt, self.response = prompt, response


def fit_judge(model: TinyQwen, pairs: list[Pair], rubric: list[int], sft_steps: int, steps: int, seed: int = 0,
              lr: float = 3e-3, batch_size: int = 32, on_step=None) -> None:
    """`sft_steps` of next-token training on the right answers, then `steps` of the verdict loss
    on balanced right/wrong answers plus the next-token loss."""
    rng = random.Random(f"judge/{seed}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for step in range(sft_steps + steps):
        batch = rng.sample(pairs, min(batch_size, len(pairs)))
        loss = answer_loss(model, batch)
        if step >= sft_steps:
            loss = loss + verdict_loss(model, rubric, _labelled(batch))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if on_step is not None:
            on_step(step, float(loss.detach()))
    model.eval()


def train_judge(plan, model_name: str, data: Path, output: Path, steps: int = 4000, sft_steps: int = 400,
                lr: float = 3e-3, held_out: float = 0.1, seed: int = 0, echo=print) -> float:
    """`aspc train-judge`: warm-start model `model_name` of the plan to judge, with the rubric of
    the plan's judge(...) source that names it; report the held-out agreement with the verifier
    and write the weights to `output`; returns that agreement."""
    from aspc.rl.threads import use_threads

    model_plan = tiny_model(plan, model_name)
    rubric = _rubric(plan, model_name)
    try:
        pairs = read_pairs(data)
        rubric_ids = encode(rubric)
    except (DataError, ValueError) as error:
        raise RewardModelError(str(error)) from None
    use_threads(1)  # a tiny model: one thread is fastest
    train, test = split(pairs, held_out, seed)
    echo(f"{len(pairs)} pairs from {data}: training on {len(train)}, holding out {len(test)} "
         f"({2 * len(test)} answers to judge)")
    torch.manual_seed(seed)
    model = TinyQwen(model_plan.arch, seed=seed)
    start, every = time.monotonic(), max(1, (sft_steps + steps) // 10)

    def progress(step: int, loss: float) -> None:
        if (step + 1) % every == 0 or step + 1 == sft_steps + steps:
            phase = "supervised" if step < sft_steps else "judging"
            echo(f"step {step + 1}/{sft_steps + steps} ({phase})  loss {loss:.4f}  {time.monotonic() - start:.0f}s")

    fit_judge(model, train, rubric_ids, sft_steps, steps, seed, lr, on_step=progress)
    agree = agreement(CpuJudge(model, rubric), test)
    echo(f"held-out agreement with the verifier: {agree:.3f} ({2 * len(test)} answers, half of them wrong)")
    save_judge(model, output, {"model": model_name, "pairs": len(pairs), "steps": steps, "sft_steps": sft_steps,
                               "seed": seed, "rubric": rubric, "held_out_agreement": f"{agree:.4f}"})
    echo(f"wrote {output} ({output.stat().st_size / 1024:.0f} KiB)")
    return agree


def _rubric(plan, name: str) -> str:
    """The prompt of the first judge(...) source that names the model ("" if none does)."""
    for stage in plan.stages_of("reward"):
        for source in dict(stage.options)["sources"]:
            if source.func == "judge" and source.get("model") == name:
                return source.get("prompt")
    return ""


def save_judge(model: TinyQwen, path: Path, metadata: dict) -> None:
    try:
        save_weights(model, path, metadata)
    except OSError as error:
        raise RewardModelError(f"cannot write {path}: {error.strerror}") from None


def load_judge(arch: ModelArch, path: Path, name: str) -> TinyQwen:
    """The judge `name` with the weights in `path`; CheckpointError names the path."""
    return load_weights(TinyQwen(arch), path, f"model '{name}': judge", TRAIN_HINT)
