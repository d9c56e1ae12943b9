"""The frozen reference policy on the trainer's ranks (verl's megatron reference policy): which
checkpoint it loads (the plan's `reference` stage; for frozen(actor), the actor's), and the second
GPTModel of the train stage that every rank builds from it, in eval mode, without gradients."""
from __future__ import annotations

from aspc.backends.ascend.megatron_model import arch_of, build_gpt, load_checkpoint


def reference_checkpoint(stages: list[dict], train: dict) -> str | None:
    """The checkpoint directory of the plan's reference model (a `reference` launch stage; for
    frozen(actor), the actor's), or None without one. The frozen reference is built in the trainer's
    processes, on its parallel layout, so it must have the policy's architecture."""
    found = next((s for s in stages if s["kind"] == "reference"), None)
    if found is None:
        return None
    if arch_of(found) != arch_of(train):
        raise ValueError(f"stage '{found['stage']}': the reference model's architecture differs from the "
                         "policy's; the NPU trainer builds its frozen reference on the policy's ranks and layout: "
                         "use frozen(<policy model>) or a checkpoint of the same architecture")
    return found["builders"]["checkpoint"]


def frozen_reference(stage: dict, rank_args: dict, checkpoint: str | None):
    """The reference policy on this rank (every rank builds it, in the same order): a second GPTModel
    of the train stage, eval mode, no gradients, loaded from the reference's checkpoint (verl's
    megatron reference policy); None without a reference stage."""
    if checkpoint is None:
        return None
    model = load_checkpoint(build_gpt(stage, rank_args), stage, checkpoint).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model
