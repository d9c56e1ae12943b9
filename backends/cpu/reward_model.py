"""A learned reward model (RLHF): the TinyQwen decoder with a scalar head read at the last token
of prompt + response, its weights from a safetensors file that `aspc train-rm` writes by fitting a
Bradley-Terry loss, -log sigmoid(r_chosen - r_rejected), on preference pairs.

A reward stage with model(...) sources runs on its own executor (scoring.py).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from aspc.backends.cpu.batching import make_batch
from aspc.rl.checkpoint import CheckpointError
from aspc.rl.data import DataError, json_objects
from aspc.backends.cpu.model import TinyQwen
from aspc.rl.tokenizer import BOS, EOS, encode
from aspc.ir.facts import ModelArch

TRAIN_HINT = "train one with `aspc train-rm FILE.aspl --model NAME --data prefs.jsonl -o PATH`"


class RewardModel(torch.nn.Module):
    """Scores token sequences: one scalar per (prompt ids, response ids)."""

    def __init__(self, arch: ModelArch, seed: int = 0):
        super().__init__()
        self.decoder = TinyQwen(arch, seed=seed, value_head=True)

    def forward(self, pairs: list[tuple[list[int], list[int]]]) -> torch.Tensor:
        max_seq = self.decoder.arch.max_seq
        pairs = [(p, r[:max(0, max_seq - len(p))]) for p, r in pairs]  # what does not fit is not read
        batch = make_batch(pairs)
        values = self.decoder.values(batch.tokens, batch.positions, batch.mask)  # [B, T]
        last = torch.tensor([len(p) + len(r) - 1 for p, r in pairs])
        return values[torch.arange(len(pairs)), last]


def save_reward_model(model: RewardModel, path: Path, metadata: dict | None = None) -> None:
    save_weights(model, path, metadata or {})


def load_reward_model(arch: ModelArch, path: Path, name: str = "rm") -> RewardModel:
    """The reward model `name` with the weights in `path`; CheckpointError names the path."""
    return load_weights(RewardModel(arch), path, f"model '{name}': reward model", TRAIN_HINT)


def save_weights(module: torch.nn.Module, path: Path, metadata: dict) -> None:
    """A scorer's weights as safetensors, with string metadata (how it was trained)."""
    state = {k: v.detach().contiguous().clone() for k, v in module.state_dict().items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path), metadata={k: str(v) for k, v in metadata.items()})


def load_weights(module: torch.nn.Module, path: Path, what: str, hint: str):
    """`module` with the weights in `path`, in eval mode; a CheckpointError names `what`, the path
    and `hint` (the command that writes one) when the file is missing, torn or of another shape."""
    if not path.is_file():
        raise CheckpointError(f"{what} checkpoint {path} does not exist; {hint}")
    try:
        module.load_state_dict(load_file(str(path)))
    except Exception as error:  # not safetensors, or another model's shapes
        first = str(error).splitlines()[0] if str(error) else ""
        raise CheckpointError(f"{what}: cannot load the checkpoint {path} ({type(error).__name__}: {first}); "
                              f"{hint} with this model's shape") from None
    return module.eval()


def checkpoint_path(checkpoint: str, base_dir: Path | None) -> Path:
    path = Path(checkpoint)
    return path if path.is_absolute() or base_dir is None else Path(base_dir) / path


# ---- preference data and the Bradley-Terry fit ----
@dataclass(frozen=True)
class Pair:
    prompt: list[int]
    chosen: list[int]
    rejected: list[int]


def read_pairs(path: Path) -> list[Pair]:
    """JSONL rows {"prompt", "chosen", "rejected"} (strings), tokenized as the policy sees them:
    BOS + prompt, response + EOS. A bad row is a DataError naming the file and line."""
    pairs = []
    for number, row in json_objects(path, "preference file"):
        if not all(isinstance(row.get(k), str) for k in ("prompt", "chosen", "rejected")):
            raise DataError(f'{path}:{number}: each line needs string "prompt", "chosen" and "rejected" fields')
        try:
            pairs.append(Pair([BOS] + encode(row["prompt"]), encode(row["chosen"]) + [EOS],
                              encode(row["rejected"]) + [EOS]))
        except ValueError as error:
            raise DataError(f"{path}:{number}: {error}") from None
    if len(pairs) < 2:
        raise DataError(f"{path}: needs at least 2 preference pairs (one held out), found {len(pairs)}")
    return pairs


def split(pairs: list[Pair], held_out: float = 0.1, seed: int = 0) -> tuple[list[Pair], list[Pair]]:
    """A seeded split: (pairs to train on, held-out pairs the fit never sees)."""
    order = list(range(len(pairs)))
    random.Random(f"split/{seed}").shuffle(order)
    n_test = max(1, round(len(pairs) * held_out))
    return [pairs[i] for i in order[n_test:]], [pairs[i] for i in order[:n_test]]


def bradley_terry_loss(model: RewardModel, pairs: list[Pair]) -> tuple[torch.Tensor, float]:
    """Mean -log sigmoid(r_chosen - r_rejected), and the fraction of pairs ranked correctly."""
    scores = model([(p.prompt, p.chosen) for p in pairs] + [(p.prompt, p.rejected) for p in pairs])
    margin = scores[:len(pairs)] - scores[len(pairs):]
    return -torch.nn.functional.logsigmoid(margin).mean(), float((margin > 0).float().mean())


@torch.no_grad()
def pairwise_accuracy(model: RewardModel, pairs: list[Pair], batch_size: int = 256) -> float:
    model.eval()
    right = 0.0
    for i in range(0, len(pairs), batch_size):
        chunk = pairs[i:i + batch_size]
        right += bradley_terry_loss(model, chunk)[1] * len(chunk)
    return right / len(pairs)


def supervised_start(model: RewardModel, pairs: list[Pair], steps: int, seed: int = 0, batch_size: int = 32,
                     lr: float = 3e-3) -> float:
    """Next-token training of the decoder on the chosen responses (prompt -> chosen), as RLHF starts
    its reward model from the supervised model: the scalar head then reads a decoder that already
    models right answers. Returns the last loss."""
    from aspc.backends.cpu.batching import token_logprobs

    rng = random.Random(f"sft/{seed}")
    optimizer = torch.optim.AdamW(model.decoder.parameters(), lr=lr)
    loss_value = float("nan")
    model.train()
    for _ in range(steps):
        batch = make_batch([(p.prompt, p.chosen) for p in rng.sample(pairs, min(batch_size, len(pairs)))])
        logp, _ = token_logprobs(model.decoder, batch)
        mask = batch.response_mask()
        loss = -(logp * mask).sum() / mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss_value = float(loss.detach())
    model.eval()
    return loss_value


def fit(model: RewardModel, pairs: list[Pair], steps: int, seed: int = 0, batch_size: int = 64,
        lr: float = 2e-3, on_step=None) -> float:
    """AdamW on the Bradley-Terry loss with a cosine schedule; returns the last loss."""
    rng = random.Random(f"fit/{seed}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / max(steps, 1))))
    loss_value = float("nan")
    model.train()
    for step in range(steps):
        batch = rng.sample(pairs, min(batch_size, len(pairs)))
        loss, accuracy = bradley_terry_loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        loss_value = float(loss.detach())
        if on_step is not None:
            on_step(step, loss_value, accuracy)
    model.eval()
    return loss_value


class RewardModelError(Exception):
    """`aspc train-rm` cannot run (message: what, and what to do)."""


def train_reward_model(plan, model_name: str, data: Path, output: Path, steps: int, lr: float = 1e-3,
                       held_out: float = 0.1, seed: int = 0, echo=print, sft_steps: int = 400) -> float:
    """`aspc train-rm`: fit model `model_name` of the plan on the pairs in `data`, report the
    held-out pairwise accuracy and write the weights to `output`; returns that accuracy."""
    import time

    from aspc.rl.threads import use_threads

    model_plan = tiny_model(plan, model_name)
    try:
        pairs = read_pairs(data)
        model = RewardModel(model_plan.arch, seed=seed)
    except (DataError, ValueError) as error:
        raise RewardModelError(str(error)) from None
    use_threads(1)  # a tiny model: one thread is fastest, and leaves the other cores alone
    train, test = split(pairs, held_out, seed)
    echo(f"{len(pairs)} pairs from {data}: training on {len(train)}, holding out {len(test)}")
    start = time.monotonic()
    if sft_steps:
        loss = supervised_start(model, train, sft_steps, seed)
        echo(f"supervised start: {sft_steps} steps on the chosen responses, loss {loss:.3f}, "
             f"{time.monotonic() - start:.0f}s")
    echo(f"held-out pairwise accuracy before the fit: {pairwise_accuracy(model, test):.3f}")
    every = max(1, steps // 10)

    def progress(step: int, loss: float, accuracy: float) -> None:
        if (step + 1) % every == 0 or step + 1 == steps:
            echo(f"step {step + 1}/{steps}  loss {loss:.4f}  batch accuracy {accuracy:.3f}  "
                 f"{time.monotonic() - start:.0f}s")

    fit(model, train, steps, seed=seed, lr=lr, on_step=progress)
    accuracy = pairwise_accuracy(model, test)
    echo(f"held-out pairwise accuracy: {accuracy:.3f} ({len(test)} pairs)")
    try:
        save_reward_model(model, output, {"model": model_name, "pairs": len(pairs), "steps": steps, "seed": seed,
                                          "sft_steps": sft_steps,
                                          "held_out_accuracy": f"{accuracy:.4f}"})
    except OSError as error:
        raise RewardModelError(f"cannot write {output}: {error.strerror}") from None
    echo(f"wrote {output} ({output.stat().st_size / 1024:.0f} KiB)")
    return accuracy


def tiny_model(plan, name: str):
    """The plan's model `name`, which the CPU backend can fit (a `custom` one); RewardModelError if not."""
    names = [m.name for m in plan.models]
    if name not in names:
        raise RewardModelError(f"no model '{name}' (the models: {', '.join(names)})")
    model = plan.model(name)
    if model.preset != "custom":
        raise RewardModelError(f"model '{name}' is the preset {model.preset}; the CPU backend fits tiny `custom` "
                               "models")
    return model
