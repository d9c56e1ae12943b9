"""Measured costs in place of the roofline: for simulating a real CPU run (the CPU backend's
micro-benchmark, backends/cpu/calibrate.py, produces the Calibration). No torch here.

The costs are seconds of one core. `cores` is how many the calibrated machine lets the run use;
the simulator shares them among the workers busy at once (aspc/costmodel/cores.py): a cost below
is multiplied by the current slowdown of `share` when it is priced."""
from __future__ import annotations

from dataclasses import dataclass

from aspc.costmodel.cores import CoreShare


@dataclass(frozen=True)
class Calibration:
    decode_fixed: float  # seconds per decode step
    decode_per_seq: float  # plus seconds per sequence in the batch
    prefill_fixed: float  # seconds per prefilled request
    prefill_per_token: float
    forward_fixed: float  # a forward pass over a unit in the learner process (the reference pass) ...
    forward_per_token: float  # ... plus per token (padded) and per sample
    train_fixed: float  # a training pass over a unit (forward, loss and backward)
    train_per_token: float
    optimizer: float
    weight_load: float  # a generation process receives a version through its pipe and loads it
    forward_per_sample: float = 0.0  # the learner's Python work per sample: batching, lists, pickles
    train_per_sample: float = 0.0
    cores: int = 1  # the cores the calibrated process could run on (os.sched_getaffinity)
    background: float = 0.0  # cores other processes kept busy on average while it was calibrated
    step_round_trip: float = 0.0  # a process worker's pipe round trip, paid per decode step
    publish: float = 0.0  # the learner snapshots a version and sends it to the controller's process
    switch: float = 0.0  # a time-shared pool changes hands (a hand-off between two threads)
    score_fixed: float = 0.0  # a reward model's forward pass over a unit, in the controller's process
    score_per_sample: float = 0.0
    score_per_token: float = 0.0
    judge_fixed: float = 0.0  # a judge's unit: one call per sample on threads of the controller's process
    judge_per_sample: float = 0.0
    critic_train_fixed: float = 0.0  # a training pass that also trains a critic (PPO)
    critic_train_per_sample: float = 0.0
    critic_train_per_token: float = 0.0
    critic_optimizer: float = 0.0  # the optimizer step of the actor and the critic


@dataclass(frozen=True)
class CalibratedGeneration:
    """A process worker's decode step: the step itself and its pipe round trip to the controller."""

    cal: Calibration
    alpha: float = 0.0  # context length barely matters at these sizes (measured into beta)
    share: CoreShare | None = None
    skips_finished: bool = True  # a static batch's finished sequences cost nothing (backends/cpu/generator.py)

    def beta(self, batch: int) -> float:
        step = self.cal.decode_fixed + self.cal.decode_per_seq * batch + self.cal.step_round_trip
        return step * _slowdown(self.share)

    def prefill(self, tokens: int, requests: int = 1, squares: float = 0.0) -> float:
        """Measured per token at the CPU runtime's lengths (attention included there: `squares` unused)."""
        return (self.cal.prefill_fixed * requests + self.cal.prefill_per_token * tokens) * _slowdown(self.share)


@dataclass(frozen=True)
class CalibratedLearner:
    """The learner process's passes; `critic`: its train passes train a critic too (PPO). The
    driver shares the cores for learner-side work (aspc/costmodel/cores.py, `settle`), so these
    are core-seconds."""

    cal: Calibration
    rank_devices: int = 1
    critic: bool = False

    def forward(self, tokens: int, squares: float = 0.0, samples: int = 0) -> float:
        c = self.cal
        return c.forward_fixed + c.forward_per_sample * samples + c.forward_per_token * tokens

    def train(self, tokens: int, squares: float = 0.0, samples: int = 0) -> float:
        c = self.cal
        if self.critic:
            return c.critic_train_fixed + c.critic_train_per_sample * samples + c.critic_train_per_token * tokens
        return c.train_fixed + c.train_per_sample * samples + c.train_per_token * tokens

    def optimizer(self) -> float:
        return self.cal.critic_optimizer if self.critic else self.cal.optimizer


@dataclass(frozen=True)
class CalibratedScorer:
    """A reward model's forward pass over a unit in the controller's process, or a judge's unit
    there (the CPU judge reads its verdict from one forward pass per sample: no verdict tokens are
    decoded)."""

    cal: Calibration
    rank_devices: int = 1

    def forward(self, tokens: int, squares: float = 0.0, samples: int = 0) -> float:
        return self.cal.score_fixed + self.cal.score_per_sample * samples + self.cal.score_per_token * tokens

    def judge(self, samples: int) -> float:
        return self.cal.judge_fixed + self.cal.judge_per_sample * samples


def _slowdown(share: CoreShare | None) -> float:
    return 1.0 if share is None else share.factor
