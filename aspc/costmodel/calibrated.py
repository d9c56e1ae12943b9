"""Measured costs in place of the roofline: for simulating a real CPU run (the CPU backend's
micro-benchmark, backends/cpu/calibrate.py, produces the Calibration). No torch here."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Calibration:
    decode_fixed: float  # seconds per decode step
    decode_per_seq: float  # plus seconds per sequence in the batch
    prefill_fixed: float  # seconds per prefilled request
    prefill_per_token: float
    forward_fixed: float  # seconds per forward micro-batch
    forward_per_token: float
    train_fixed: float  # seconds per training micro-batch (forward and backward)
    train_per_token: float
    optimizer: float
    weight_load: float


@dataclass(frozen=True)
class CalibratedGeneration:
    cal: Calibration
    alpha: float = 0.0  # context length barely matters at these sizes (measured into beta)

    def beta(self, batch: int) -> float:
        return self.cal.decode_fixed + self.cal.decode_per_seq * batch

    def prefill(self, tokens: int, requests: int = 1) -> float:
        return self.cal.prefill_fixed * requests + self.cal.prefill_per_token * tokens


@dataclass(frozen=True)
class CalibratedLearner:
    cal: Calibration
    rank_devices: int = 1

    def forward(self, tokens: int, squares: float) -> float:
        return self.cal.forward_fixed + self.cal.forward_per_token * tokens

    def train(self, tokens: int, squares: float) -> float:
        return self.cal.train_fixed + self.cal.train_per_token * tokens

    def optimizer(self) -> float:
        return self.cal.optimizer
