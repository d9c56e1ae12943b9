"""The CPU backend with each distinct warm start made once per test session: a warm start is
deterministic (the same initial weights, data, demonstrations and steps train the same policy), and
the learning tests of several files start runs of one seed from the same one (tiny_rlaif and
tiny_rlhf share their actor and data)."""
import hashlib

import torch

from aspc.backends.cpu.executors import CpuExecutors


class SharedWarmStart(CpuExecutors):
    made: dict[tuple, dict] = {}

    def warm_start(self, steps: int, on_step=None) -> None:
        key = (_digest(self.actor.state_dict()), repr(self.data), repr(self.env_stage), steps)
        if key not in self.made:
            super().warm_start(steps, on_step)
            self.made[key] = {k: v.clone() for k, v in self.actor.state_dict().items()}
        self.actor.load_state_dict(self.made[key])


def _digest(state: dict) -> str:
    sha = hashlib.sha256()
    for name, tensor in state.items():
        sha.update(name.encode())
        sha.update(tensor.detach().to(torch.float32).numpy().tobytes())
    return sha.hexdigest()
