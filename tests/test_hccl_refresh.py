"""A separate pool's weight refresh through vllm-ascend 0.23.0's own HCCL send (issue 33, defect 1):
`HCCLWeightTransferEngine.trainer_send_weights` and its argument class are executed from the wheel's
source (read, never installed: tests/wheel_sources.py); the communicator is a stand-in for
PyHcclCommunicator with the real class's `device` and `broadcast` signature (checked against the
wheel) and its assertion that every tensor is on the communicator's NPU ("meta" plays the NPU here).
The trainer stages versions in host memory; executors.hccl_sender hands them to the real send one
tensor at a time on the communicator's device, so no more than one tensor is ever there."""
import ast
import dataclasses
import sys
import typing
import weakref
from collections import abc
from types import SimpleNamespace

import pytest
import torch

from aspc.backends.ascend import executors
from test_ascend_conformance import stack_sources
from wheel_sources import parameters

ENGINE = "vllm_ascend.distributed.weight_transfer.hccl_engine"


def real_hccl_engine(monkeypatch):
    """HCCLTrainerSendWeightsArgs and HCCLWeightTransferEngine.trainer_send_weights, from the wheel's
    source; torch.npu (absent without torch-npu) answers the two names they read."""
    sources = stack_sources("vllm_ascend")
    tree = sources.tree(ENGINE)
    args_class = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "HCCLTrainerSendWeightsArgs")
    engine = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "HCCLWeightTransferEngine")
    send = next(n for n in engine.body if isinstance(n, ast.FunctionDef) and n.name == "trainer_send_weights")
    module = ast.Module(body=[args_class, ast.ClassDef(name="HCCLWeightTransferEngine", bases=[], keywords=[],
                                                       body=[send], decorator_list=[], type_params=[])],
                        type_ignores=[])
    monkeypatch.setattr(torch, "npu", SimpleNamespace(Stream=object, current_stream=lambda: None), raising=False)
    namespace = {"torch": torch, "Any": typing.Any, "Callable": abc.Callable, "Iterator": abc.Iterator,
                 "dataclass": dataclasses.dataclass,
                 "DEFAULT_PACKED_BUFFER_SIZE_BYTES": 1 << 20, "DEFAULT_PACKED_NUM_BUFFERS": 2}
    exec(compile(ast.fix_missing_locations(module), ENGINE, "exec"), namespace)
    return namespace["HCCLWeightTransferEngine"], sources


class NpuCommunicator:
    """PyHcclCommunicator as trainer_send_weights uses it: `device`, and broadcast(tensor, src,
    stream) asserting the tensor is on that device (pyhccl.py); nothing the real class lacks. Each
    tensor it is given goes to the test's `given` callback (a closure, not an attribute)."""

    def __init__(self, device: str, given=lambda tensor: None):
        self.device = torch.device(device)

        def broadcast(tensor: torch.Tensor, src: int, stream=None):
            assert tensor.device == self.device, (
                f"this hccl communicator is created to work on {self.device}, but the input tensor is on "
                f"{tensor.device}")
            given(tensor)

        self.broadcast = broadcast


def test_the_stand_in_has_the_real_communicators_broadcast_signature(monkeypatch):
    _, sources = real_hccl_engine(monkeypatch)
    real = sources.class_in("vllm_ascend.distributed.device_communicators.pyhccl", "PyHcclCommunicator")
    broadcast = next(n for n in real.body if isinstance(n, ast.FunctionDef) and n.name == "broadcast")
    assert parameters(broadcast) == {"self", "tensor", "src", "stream"}
    assert "device" in sources.members("PyHcclCommunicator")


def test_a_host_staged_version_reaches_the_npu_one_tensor_at_a_time(monkeypatch):
    """executors.hccl_sender's import of vllm-ascend finds the engine read from the wheel."""
    engine, _ = real_hccl_engine(monkeypatch)
    monkeypatch.setitem(sys.modules, ENGINE, SimpleNamespace(HCCLWeightTransferEngine=engine))
    staged = {f"model.layers.{i}.mlp.down_proj.weight": torch.randn(4, 3 + i) for i in range(5)}  # on the host
    refs, alive_at_send, shapes = [], [], []

    def given(tensor):  # at each broadcast: how many tensors given so far are still on the device
        refs.append(weakref.ref(tensor))
        alive_at_send.append(sum(ref() is not None for ref in refs))
        shapes.append(tuple(tensor.shape))

    group = NpuCommunicator("meta", given)
    executors.hccl_sender({0: group})(staged, 0)
    assert sorted(shapes) == sorted(tuple(t.shape) for t in staged.values())
    assert max(alive_at_send) == 1  # streamed: the previous tensor left the device before the next came
    with pytest.raises(AssertionError, match="created to work on meta"):  # host tensors, as staged before
        engine.trainer_send_weights(iter(staged.items()), {"group": NpuCommunicator("meta"), "src": 0})
