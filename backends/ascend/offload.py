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
        self.offloaded = offload_model(self.model) + offload_optimizer(self.optimizer, self.model)
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
    """One of megatron DDP's contiguous buffers (`param_data`, `grad_data`; the parameters and
    their .main_grad are views into them): the parameters to host memory, the device storage
    released (resized to 0, so the views stay valid); gradients dropped (zero after the optimizer
    step). Returns the restore step."""
    params, grads = buffer.param_data, buffer.grad_data
    host, sizes = _host_copy(params), (params.untyped_storage().size(), grads.untyped_storage().size())
    params.untyped_storage().resize_(0)
    grads.untyped_storage().resize_(0)

    def restore() -> None:
        params.untyped_storage().resize_(sizes[0])
        params.copy_(host)
        grads.untyped_storage().resize_(sizes[1])
        grads.zero_()

    return [restore]


def offload_model(ddp) -> list:
    """Every parameter and gradient buffer of a DDP-wrapped megatron model (dense and expert)."""
    return [step for buffer in [*ddp.buffers, *ddp.expert_parallel_buffers] for step in offload_buffer(buffer)]


def offload_optimizer(optimizer, ddp) -> list:
    """The fp32 main parameters and Adam state of megatron's optimizer (each chained optimizer's
    torch optimizer, as megatron-core 0.16's MegatronOptimizer.offload_to_cpu moves them; 0.12.1,
    MindSpeed's megatron, has no such method), to host memory; model parameters shared with the
    optimizer (no mixed precision) stay with the model's buffers."""
    model_params = {id(p) for p in ddp.parameters()}
    steps = []
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = inner.optimizer
        for group in torch_optimizer.param_groups:
            steps += [_move_data(p) for p in group["params"] if id(p) not in model_params]
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
