"""A micro-benchmark of a tiny model on this CPU, giving the simulator measured costs instead of
the roofline's datasheet numbers: decode step time by batch size, prefill per request and token,
forward and training time per micro-batch and token, the optimizer step and a weight load."""
from __future__ import annotations

import copy
import time
import torch

from aspc.backends.cpu.batching import make_batch, token_logprobs
from aspc.backends.cpu.generator import BatchGenerator
from aspc.backends.cpu.model import TinyQwen
from aspc.costmodel.calibrated import Calibration


def _timed(fn, repeat: int = 5) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares intercept and slope, both kept non-negative."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / max(sum((x - mx) ** 2 for x, _ in points), 1e-12)
    slope = max(slope, 0.0)
    return max(my - slope * mx, 0.0), slope


def _generator(model, batch: int, prompt: int) -> BatchGenerator:
    """The real generator (sampling included), its sequences never ending within the benchmark."""
    generator = BatchGenerator(model, batch, max_tokens=model.arch.max_seq, temperature=1.0)
    for i in range(batch):
        generator.add(i, [1] + [5] * (prompt - 1), seed=i)
    return generator


def _decode(model, batch: int) -> float:
    generator = _generator(model, batch, 8)
    generator.step()  # admit and prefill
    return _timed(generator.step, repeat=8)


def _prefill(model, length: int) -> float:
    """Admitting one request: its prefill and first sampled token, beyond a decode step."""
    def admit():
        generator = _generator(model, 1, length)
        generator._admit()
    return _timed(admit)


def _learner(model, sequences: int, length: int, train: bool) -> float:
    batch = make_batch([([1] * (length // 2), [5] * (length - length // 2))] * sequences)

    def run():
        if train:
            logp, _ = token_logprobs(model, batch)
            logp.sum().backward()
        else:
            with torch.no_grad():
                token_logprobs(model, batch)
    return _timed(run, repeat=3)


def calibrate(arch, length: int = 24) -> Calibration:
    model = TinyQwen(arch, seed=0)
    decode = _line([(b, _decode(model.eval(), b)) for b in (1, 4, 16, 32)])
    model.train()
    prefill = _line([(n, _prefill(model, n)) for n in (4, 12, 24)])
    forward = _line([(s * length, _learner(model, s, length, False)) for s in (2, 8, 32)])
    train = _line([(s * length, _learner(model.train(), s, length, True)) for s in (2, 8, 32)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    state = copy.deepcopy(model.state_dict())
    return Calibration(decode[0], decode[1], prefill[0], prefill[1], forward[0], forward[1], train[0], train[1],
                       _timed(optimizer.step), _timed(lambda: model.load_state_dict(state)))
