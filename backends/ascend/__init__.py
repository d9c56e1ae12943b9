"""The Ascend backend: lowering an execution plan to a launch plan (pure, tested on CPU), and
executors that import torch_npu, torchair, vllm and megatron only inside functions that run on
an NPU."""
