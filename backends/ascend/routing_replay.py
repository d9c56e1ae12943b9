"""Rollout routing replay (R3) in the megatron trainer: megatron-core's RouterReplay
(`moe_enable_routing_replay`, megatron/core/transformer/moe/router_replay.py, 0.16.1) gives each
router of the model the experts to use for a micro-batch's tokens; the gate weights stay the
router's scores at those experts (topk_routing_with_score_function gathers them), as the CPU
learner's replay (backends/cpu/model.py `Routing`).

The routers are this rank's own (its pipeline stage's MoE layers, found in the model rather than in
RouterReplay's process-wide list, which every model built in the process appends to); each takes
its MoE layer's slice of the packed row's routes ([1, T, moe layers, top_k], packing.py: b = 1, so a
router's tokens are the row's positions). With pp = 1 each micro-batch's backward follows its forward,
so a recomputed forward finds the same targets; the trainer refuses tensor parallelism (sequence
parallelism splits the tokens), context parallelism, and recompute under pipeline parallelism."""
from __future__ import annotations

import torch

# RouterReplay came with megatron-core 0.16; the NPU install pins MindSpeed's pair (aspc/cli/npu_install.py),
# which has none: the trainer refuses routing replay on NPUs until that pin reaches REPLAY_SINCE
NPU_MEGATRON = (0, 12, 1)
REPLAY_SINCE = (0, 16)


def replay_routers(model, layer_freq=None) -> list[tuple[int, object]]:
    """(index among the model's MoE layers, RouterReplay) of each router of `model` that replays.
    `layer_freq`: the config's moe_layer_freq (a 0/1 list per layer; None or an int: every layer)."""
    found = []
    for module in model.modules():
        replay = getattr(module, "router_replay", None)
        if replay is not None:
            layer = module.layer_number - 1  # megatron numbers a model's layers from 1, over every stage
            found.append((sum(layer_freq[:layer]) if isinstance(layer_freq, list) else layer, replay))
    return found


def replay(routers: list, routes: torch.Tensor) -> None:
    """The next forward routes each token of the row through `routes`' experts."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    layers = routes.shape[2]
    for index, router in routers:
        if index >= layers:
            raise ValueError(f"the samples' routes have {layers} MoE layers, and the trainer's model has more")
        router.set_target_indices(routes[0, :, index].to(torch.long))
        router.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def stop_replay(routers: list) -> None:
    """Routers choose again (the reference's and the next unit's forwards), their targets dropped."""
    for _, router in routers:
        router.clear_indices()
        router.clear_router_replay_action()
