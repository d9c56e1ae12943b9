"""Offload and onload for time-shared pools: a megatron model's parameter and gradient buffers and
its optimizer's fp32 main parameters and Adam state leave the NPU while the pool generates, and come
back when it trains (verl's offload_megatron_model_to_cpu / offload_megatron_optimizer)."""
from __future__ import annotations

import torch


class Offloadable:
    """A megatron model (`model`, its DDP wrapper) and its `optimizer` that leave the NPU while a
    time-shared pool generates (`offloaded`: what brings them back)."""

    offloaded: list

    def offload(self) -> None:
        """A time-shared pool goes to generation: parameters, gradients and optimizer state to host
        memory (verl's offload_megatron_model_to_cpu / offload_megatron_optimizer); once."""
        if self.offloaded:
            return
        optimizer = offload_optimizer(self.optimizer, self.model)  # first: it tells the model's storage apart
        self.offloaded = offload_model(self.model) + optimizer
        empty_device_cache()

    def onload(self) -> None:
        """The pool comes back to the trainer: everything `offload` moved goes back where it was."""
        for restore in self.offloaded:
            restore()
        self.offloaded = []


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    host = tensor.detach().to("cpu", copy=True)
    return host.pin_memory() if tensor.device.type != "cpu" else host


def offload_buffer(buffer) -> list:
    """One of megatron DDP's contiguous buffers: `grad_data` (each parameter's .main_grad a view into
    it) and, with the distributed optimizer, `param_data` (each parameter a view into it; without it
    megatron leaves param_data None and every parameter keeps its own storage). Parameters go to host
    memory and their device storage is released (resized to 0, so the views stay valid); gradients
    are dropped (zero after the optimizer step). Returns the restore steps."""
    held = [buffer.param_data] if buffer.param_data is not None else list(buffer.params)
    return [_release(t, keep=True) for t in held] + [_release(buffer.grad_data, keep=False)]


def _release(tensor: torch.Tensor, keep: bool):
    """Free `tensor`'s device storage (its views stay valid); restore it as it was (`keep`) or zeroed."""
    storage = tensor.untyped_storage()
    host, size = _host_copy(tensor) if keep else None, storage.size()
    storage.resize_(0)

    def restore() -> None:
        storage.resize_(size)
        if keep:
            tensor.data.copy_(host)
        else:
            tensor.data.zero_()

    return restore


def offload_model(ddp) -> list:
    """Every parameter and gradient buffer of a DDP-wrapped megatron model (dense and expert)."""
    return [step for buffer in [*ddp.buffers, *ddp.expert_parallel_buffers] for step in offload_buffer(buffer)]


def offload_optimizer(optimizer, ddp) -> list:
    """The fp32 main parameters and Adam state of megatron's optimizer (each chained optimizer's
    torch optimizer, as megatron-core 0.16's MegatronOptimizer.offload_to_cpu moves them; 0.12.1,
    MindSpeed's megatron, has no such method), to host memory. What lives in the model's storage
    stays with the model's buffers: fp32 parameters themselves (no mixed precision), or with the
    distributed optimizer their shards, views into DDP's param_data. Call it before offload_model."""
    model_storage = {p.untyped_storage().data_ptr() for p in ddp.parameters()}
    steps = []
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = inner.optimizer
        for group in torch_optimizer.param_groups:
            steps += [_move_data(p) for p in group["params"] if p.untyped_storage().data_ptr() not in model_storage]
        for state in torch_optimizer.state.values():
            steps += [_move_entry(state, key) for key, value in state.items() if isinstance(value, torch.Tensor)]
    return steps


def _move_data(param: torch.Tensor):
    device, param.data = param.device, _host_copy(param.data)

    def restore() -> None:
        param.data = param.data.to(device)

    return restore


def _move_entry(state: dict, key: str):
    device, state[key] = state[key].device, _host_copy(state[key])

    def restore() -> None:
        state[key] = state[key].to(device)

    return restore


def empty_device_cache() -> None:
    """Give freed device memory back (torch_npu's caching allocator keeps it otherwise)."""
    npu = getattr(torch, "npu", None)
    if npu is not None and npu.is_available():
        npu.empty_cache()
