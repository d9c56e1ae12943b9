"""A two-rank torch.distributed (gloo) job for tests/test_ascend_executors.py: rank 0 leads a
recording trainer (backends/ascend/call_broadcast.py's Leader) and critic (a Leader with the prefix
"critic.", as critic.MegatronCritic.build returns on a job of several ranks), and rank 1 follows
their calls; then both reshard a TP2 model over real collectives (weight_sync.TorchCommunicator)."""
import torch
import torch.distributed as dist

from aspc.backends.ascend import reshard
from aspc.backends.ascend.groups import process_groups
from aspc.backends.ascend.call_broadcast import Leader, follow
from aspc.backends.ascend.weight_sync import TorchCommunicator, coords_of, gather_hf, reshard_in_place
from aspc.ir.facts import ModelArch
from aspc.ir.graph import Parallel

ARCH = ModelArch(layers=2, hidden=8, heads=4, kv_heads=2, head_dim=2, ffn=16, vocab=16, qkv_bias=True)


class Recorder:
    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *args: self.calls.append((name, args))


def checkpoint() -> dict:
    generator = torch.Generator().manual_seed(3)
    return reshard.to_hf(ARCH, {name: torch.randn(shape, generator=generator)
                                for name, shape in reshard.full_shapes(ARCH).items()})


def run(rank: int, store: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    trainer, critic = Recorder(), Recorder()
    if rank == 0:
        leader, critic_leader = Leader(trainer), Leader(critic, prefix="critic.")
        leader.reward(["r1"])
        critic_leader.values(["r1", "r2"])
        leader.train(["r1", "r2"])
        critic_leader.train(["r1", "r2"])
        leader.optimizer_step()
        leader.snapshot()
        leader.close()
    else:
        trainer.critic = critic  # the follower's share of the critic (MegatronTrainer.attach_critic)
        follow(trainer)
    par = Parallel(tp=2)
    comm = TorchCommunicator(g for groups in process_groups(par).values() for g in groups)
    local = reshard.shard_state(ARCH, reshard.from_hf(ARCH, checkpoint()), 2, 1, 1, coords_of(par, rank))
    whole = reshard_in_place(ARCH, local, par, 1, comm)  # TP2 -> TP1: every rank the whole model
    hf = gather_hf(ARCH, local, par, comm)
    results.put((rank, (trainer.calls, critic.calls, _same(whole), _same_hf(hf, rank))))
    dist.destroy_process_group()


def _same(whole: dict) -> bool:
    expected = reshard.from_hf(ARCH, checkpoint())
    return sorted(whole) == sorted(expected) and all(torch.equal(whole[n], expected[n]) for n in expected)


def _same_hf(hf: dict, rank: int) -> bool:
    if rank != 0:
        return hf == {}
    expected = checkpoint()
    return sorted(hf) == sorted(expected) and all(torch.equal(hf[n], expected[n]) for n in expected)
