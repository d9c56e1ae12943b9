"""The engine worker's side of the gloo weight transfer (gloo_transfer.py): a vLLM
WeightTransferEngine (vllm/distributed/weight_transfer/base.py, vLLM 0.32), built by vLLM's
factory when the engine's weight_transfer_config names the backend "gloo". Written after vLLM's
dense NCCL engine (nccl_engine.py: one broadcast per tensor, layerwise reload around the update),
with a gloo group in place of the NCCL communicator. Imported only inside a vLLM process."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)

from aspc.backends.vllm.gloo_transfer import broadcast, gloo_group


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int  # the trainer's side is rank 0; this engine's workers follow
    world_size: int


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self):
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"gloo weight update: {len(self.names)} names, {len(self.dtype_names)} dtypes, "
                             f"{len(self.shapes)} shapes")


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        """Join the trainer's group as rank_offset + this worker's rank across data-parallel replicas."""
        parallel = self.parallel_config
        worker = parallel.data_parallel_index * parallel.world_size + parallel.rank
        self.group = gloo_group(init_info.master_address, init_info.master_port, init_info.rank_offset + worker,
                                init_info.world_size)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer: init_weight_transfer_engine was not called")
        for name, dtype_name, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes):
            weight = broadcast(self.group, torch.empty(shape, dtype=getattr(torch, dtype_name), device=self.device))
            self.model.load_weights([(name, weight)])

    def shutdown(self) -> None:
        self.group = None
