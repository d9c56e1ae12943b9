"""Real megatron-core 0.16.1 on CPU: jobs of one or more gloo processes, and the few shims for the
places where megatron-core calls CUDA unconditionally (each one line, with where and why). Nothing
else of megatron is replaced: the executors' GPTModel, DistributedDataParallel, get_megatron_optimizer
(with and without the distributed optimizer) and get_forward_backward_func are megatron's own.

`run_job(world, config, fn, *args)` runs `fn(rank, *args)` in `world` spawned processes after the
executors' own `initialize_parallel` (megatron_model.py: torch.distributed over gloo, megatron's
model-parallel state from a launch stage's `config`, the RNG tracker) ran under the shims; it returns
each rank's result."""
from __future__ import annotations

import contextlib
import logging
import os
import pickle
import tempfile
import traceback
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode


def _host(device):
    return "cpu" if device is not None and torch.device(device).type == "cuda" else device


class CudaIsHost(TorchFunctionMode):
    """Tensors megatron creates with device="cuda" (FP32Optimizer's loss scale, optimizer/optimizer.py:907;
    the distributed optimizer's and DDP's bucket bookkeeping) are made on the host, unpinned; `.cuda()` is a no-op;
    a host tensor's `.type()` names its CUDA type (the distributed optimizer sorts parameters by it,
    distrib_optimizer.py:420)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _host(kwargs["device"])
        if kwargs.get("pin_memory"):  # RoPE's CP chunk index (rope_utils.py:62): no pinned memory without a device
            kwargs["pin_memory"] = False
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


@contextlib.contextmanager
def megatron_on_cpu():
    """The shims, undone on exit."""
    import megatron.core.tensor_parallel.random as rng

    device_rng = {"state": torch.get_rng_state()}  # the "CUDA" generator's state, apart from the host's
    patches = [
        (torch.cuda, "current_device", lambda: "cpu"),  # DDP allocates its buffers there (param_and_grad_buffer.py:806)
        (torch.cuda, "get_rng_state", lambda *a, **k: device_rng["state"]),  # model_parallel_cuda_manual_seed
        (torch.cuda, "manual_seed", lambda seed: None),  # its seeds: the tracker's states stay as they were
        (torch.cuda, "synchronize", lambda *a: None),  # after pipeline p2p (p2p_communication.py:398): nothing queued
        (rng, "_get_cuda_rng_state", lambda *a, **k: device_rng["state"]),  # the RNG tracker's fork (random.py:248)
        (rng, "_set_cuda_rng_state", lambda state, *a, **k: device_rng.update(state=state)),  # and its restore
    ]
    import megatron.core.transformer.moe.moe_utils as moe_utils

    # the MoE router's gating (RouterGatingLinearFunction, moe_utils.py:1192) reads te_general_gemm, which
    # moe_utils defines only when Transformer Engine imports (moe_utils.py:25-39): without it, torch's matmul
    if not hasattr(moe_utils, "te_general_gemm"):
        patches.append((moe_utils, "te_general_gemm", None))
    saved = [(owner, name, getattr(owner, name, None)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        with CudaIsHost():
            yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def _rank_main(rank: int, world: int, port: int, folder: str, config: dict, fn, args: tuple) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    # the tracker's fork warns when the host RNG moved inside it: under the shims it initialises weights there
    logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)
    try:
        with megatron_on_cpu():
            result = run_on_rank(config, fn, rank, *args)
    except BaseException:  # the parent reports it with the rank
        result = RankFailure(rank, traceback.format_exc())
    with open(Path(folder) / f"rank{rank}.pkl", "wb") as out:
        pickle.dump(result, out)


def run_on_rank(config: dict, fn, *args):
    """`fn(*args)` in the model-parallel state of a launch stage's megatron `config`, set up as the
    executors do (torch.distributed from the environment, over gloo), torn down after."""
    from megatron.core import parallel_state

    from aspc.backends.ascend.megatron_model import initialize_parallel

    initialize_parallel(config, backend="gloo")
    try:
        return fn(*args)
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


class RankFailure:
    def __init__(self, rank: int, trace: str):
        self.rank, self.trace = rank, trace


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(world: int, config: dict, fn, *args) -> list:
    """Each rank's `fn(rank, *args)`, run in `world` spawned gloo processes in the model-parallel
    state of `config` (a launch stage's megatron config); a rank's exception is raised here with its
    traceback."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(_rank_main, args=(world, free_port(), folder, config, fn, args), nprocs=world,
                           join=True, start_method="spawn")
        results = []
        for rank in range(world):
            with open(Path(folder) / f"rank{rank}.pkl", "rb") as found:
                results.append(pickle.load(found))
    failed = [r for r in results if isinstance(r, RankFailure)]
    if failed:
        raise AssertionError("\n".join(f"rank {f.rank} failed:\n{f.trace}" for f in failed))
    return results
