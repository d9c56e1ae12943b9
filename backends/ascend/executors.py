"""Executors on Ascend NPUs: one process of a launch plan. Every Ascend import is inside the function
that runs on an NPU, so this module imports on any machine; `require_npu` says clearly what is
missing.

    python -m aspc.backends.ascend.executors {generate|train|reward} --plan launch.json ...

What runs where:
- generation instances are `VllmEngine`s (engine_actor.py) and the learner is rank 0 of the train
  job, a `MegatronTrainer` behind a `Leader` (megatron_trainer.py, call_broadcast.py): the Ray
  driver holds them as actors and the controller drives them through the executor roles, as it drives the CPU backend's;
- the train job's other ranks are the processes this module starts with `--rank N` (N > 0): they
  receive rank 0's settings, build their share of the model and `follow` every model call of
  rank 0, in order, until it stops;
- weights go from trainer to engines as weight_sync.py describes (vllm-ascend's HCCL broadcast of
  Hugging Face tensors from rank 0; for colocated pools every rank's whole model, streamed one
  parameter at a time (hf_stream.py) through vllm-ascend's NPU IPC engine).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from aspc.backends.ascend.megatron_model import materialize  # noqa: F401  (the launch plan's dtypes, for tests)
from aspc.backends.ascend.reference_model import reference_stage
from aspc.platforms import NPU


class AscendUnavailable(Exception):
    """No usable NPU stack here; the message says what is missing and what to do instead."""


ALTERNATIVES = ("run `aspc run FILE --backend ascend --dry-run` to print the per-process commands "
                "for an NPU cluster, `aspc run FILE --backend cpu` to train a tiny pipeline here, or "
                "`aspc simulate FILE` to predict the cluster's throughput")


def require_npu() -> None:
    """Import torch_npu (which makes torchair importable) and find an NPU, or explain."""
    try:
        import torch_npu  # noqa: F401
    except ImportError as error:
        raise AscendUnavailable(f"torch-npu is not installed ({error}); it needs the CANN toolkit on an "
                                f"Ascend host (docs/ascend.md). Meanwhile: {ALTERNATIVES}") from None
    import torch

    if not torch.npu.is_available():
        visible = os.environ.get(NPU.visible_devices, "<unset>")
        raise AscendUnavailable(f"torch-npu is installed but no NPU is visible "
                                f"({NPU.visible_devices}={visible}). Meanwhile: {ALTERNATIVES}")


def hccl_sender(groups: dict):
    """Rank 0's send over vllm-ascend's HCCL engine: `groups[instance]` is the PyHcclCommunicator
    that HCCLWeightTransferEngine.trainer_init returned for that instance's weight-transfer group
    (vllm_ascend/distributed/weight_transfer/hccl_engine.py). The version is staged in host memory
    (weight_sync.StagedVersions); its broadcast asserts each tensor is on the communicator's NPU
    (PyHcclCommunicator.broadcast), so each goes there as the engine takes it, one at a time."""
    from vllm_ascend.distributed.weight_transfer.hccl_engine import HCCLWeightTransferEngine

    from aspc.backends.ascend.weight_sync import on_device

    def send(tensors: dict, instance: int) -> None:
        group = groups[instance]
        HCCLWeightTransferEngine.trainer_send_weights(on_device(tensors, group.device), {"group": group, "src": 0})

    return send


def npu_ipc_sender(bucket_bytes: int):
    """A trainer rank's send over vllm-ascend's NPU IPC engine (colocated pools): every rank of the
    job calls it together (the IPC handles are all-gathered over the default group); each chunk goes
    through one IPC buffer of `bucket_bytes` (the launch plan's weight_refresh; at least the largest
    tensor) on the rank's NPU and rank 0 calls `deliver` with its update_info
    (vllm_ascend/distributed/weight_transfer/npu_ipc_engine.py, packed mode: bounded NPU memory).
    The tensors come one at a time from the rank's HfStream (hf_stream.py)."""
    from vllm_ascend.distributed.weight_transfer.npu_ipc_engine import NPUIPCWeightTransferEngine

    from aspc.backends.ascend.weight_sync import largest_bytes, named_tensors

    def send(tensors, deliver) -> None:
        NPUIPCWeightTransferEngine.trainer_send_weights(
            named_tensors(tensors),
            {"send_mode": deliver, "packed": True,
             "packed_buffer_size_bytes": max(bucket_bytes, largest_bytes(tensors))})

    return send


def join_transfer_group(init_info: dict):
    """Trainer rank 0 joins one instance's weight-transfer group as its rank 0 (the engine's workers
    join at the same time through VllmEngine.connect)."""
    from vllm_ascend.distributed.weight_transfer.hccl_engine import HCCLWeightTransferEngine

    return HCCLWeightTransferEngine.trainer_init(init_info)


def start_rank(stage: dict, rank_args: dict):
    """Any rank of a megatron job: MindSpeed's adaptor with the plan's flags, the process groups,
    then the trainer's settings from rank 0 (the first broadcast of the job)."""
    from aspc.backends.ascend.call_broadcast import broadcast_call
    from aspc.backends.ascend.megatron_model import import_mindspeed, initialize_parallel

    import_mindspeed(stage["builders"].get("mindspeed_argv", []))
    initialize_parallel(stage["config"])
    return broadcast_call(None)


def run_follower(stage: dict, rank_args: dict, sync, reference: dict | None = None) -> int:
    """A megatron rank other than 0: build its share of the model (and of the frozen reference of
    the `reference` launch stage, as rank 0 does), then run rank 0's calls."""
    from aspc.backends.ascend.call_broadcast import follow
    from aspc.backends.ascend.megatron_trainer import MegatronTrainer
    from aspc.backends.ascend.reference_model import frozen_reference

    settings = start_rank(stage, rank_args)
    frozen = frozen_reference(stage, rank_args, reference)
    trainer = MegatronTrainer(stage, rank_args, settings, task_reward=None, sync=sync, reference=frozen)
    return follow(trainer)


def build_engine(stage: dict, instance: int):
    """A generation instance: vLLM's engine with the launch plan's arguments (vllm-ascend registers
    itself as vLLM's platform plugin)."""
    from aspc.backends.ascend.engine_actor import VllmEngine

    return VllmEngine(stage, instance)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Start one aspc process on an Ascend NPU host.")
    parser.add_argument("role", choices=["generate", "train", "reward"])  # reference, critic: on the train ranks
    parser.add_argument("--plan", required=True)
    parser.add_argument("--stage", required=True)
    parser.add_argument("--instance", type=int, default=0)
    parser.add_argument("--dp-rank", type=int, default=0)
    parser.add_argument("--rank", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        require_npu()
        with open(args.plan, encoding="utf-8") as plan_file:
            launch = json.load(plan_file)
        stage = _one(launch["stages"], args.stage, None)
        if args.role == "reward":  # a reward model's ranks > 0 follow its scorer process (reward_model.py)
            from aspc.backends.ascend.reward_model import run_rank

            return run_rank(launch, args.stage, args.instance, args.rank)
        if args.role == "generate" and stage.get("kind") == "reward":  # a judge's engine (scorers.py)
            print(f"aspc: the judge engine of stage {args.stage} runs in the scorer process `aspc run FILE "
                  f"--backend ascend` starts for it", file=sys.stderr)
            return 2
        if args.role == "generate" or args.rank == 0:
            print(f"aspc: {args.role} {args.stage} (rank 0 / engines) runs as an actor of the controller: start it "
                  f"with `aspc run FILE --backend ascend --runtime ray`", file=sys.stderr)
            return 2
        process = _one(launch["processes"], args.stage, args.rank)
        sync = _follower_sync(stage, process["world_size"], launch if colocated(launch) else None)
        ran = run_follower(stage, process["model_args"], sync, reference_stage(launch["stages"], stage))
    except AscendUnavailable as error:
        print(f"aspc: {error}", file=sys.stderr)
        return 1
    except NotInPlan as error:
        print(f"aspc: {args.plan}: {error}; start the processes `aspc run FILE --backend ascend --dry-run` "
              "prints for this plan", file=sys.stderr)
        return 2
    print(f"aspc: {args.role} rank {args.rank} of stage {args.stage} ran {ran} calls and stopped", file=sys.stderr)
    return 0


class NotInPlan(LookupError):
    """The command line names a stage or a rank the launch plan does not have."""


def _one(entries: list[dict], stage: str, rank: int | None) -> dict:
    """The plan's stage (rank None) or the stage's process of that rank."""
    found = next((e for e in entries if e["stage"] == stage and (rank is None or e["rank"] == rank)), None)
    if found is None:
        raise NotInPlan(f"no stage '{stage}'" if rank is None else f"no process of rank {rank} in stage '{stage}'")
    return found


def colocated(launch: dict) -> bool:
    """The engines share the trainer's NPUs: their refresh is vllm-ascend's NPU IPC transfer."""
    return any((s.get("micro_batching") or {}).get("weight_refresh", {}).get("backend") == "npu_ipc"
               for s in launch["stages"] if s["role"] == "vllm-engine")


def bucket_bytes(launch: dict) -> int:
    """The NPU IPC buffer of a colocated refresh (the launch plan's weight_refresh)."""
    from aspc.backends.ascend.engine_args import WEIGHT_BUCKET_BYTES

    refreshes = [(s.get("micro_batching") or {}).get("weight_refresh") or {} for s in launch["stages"]]
    return next((r.get("bucket_bytes", WEIGHT_BUCKET_BYTES) for r in refreshes if r.get("backend") == "npu_ipc"),
                WEIGHT_BUCKET_BYTES)


def _follower_sync(stage: dict, world_size: int, launch: dict | None = None):
    """A follower's share in publishing weights: the stage's process groups; on a colocated pool
    (`launch` given) its own NPU IPC sender too (the engine worker on its NPU loads from it; rank 0
    delivers)."""
    shared = launch is not None
    from aspc.backends.ascend.megatron_model import layout_of
    from aspc.backends.ascend.megatron_trainer import SyncSetup
    from aspc.backends.ascend.weight_sync import IpcSender, TorchCommunicator

    arch, parallel, layout = layout_of(stage, world_size)
    comm = TorchCommunicator(g for axis in stage["groups"].values() for g in axis)
    sender = IpcSender(npu_ipc_sender(bucket_bytes(launch))) if shared else None
    return SyncSetup(arch, parallel, comm, sender, colocated=shared, layout=layout)


if __name__ == "__main__":
    sys.exit(main())
