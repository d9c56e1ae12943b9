"""The frozen reference policy on the trainer's ranks (verl's megatron reference policy): the plan's
`reference` launch stage (its checkpoint; for frozen(actor), the actor's; its torchair config), and
the second GPTModel of the train stage that every rank builds from it, in eval mode, without
gradients, compiled as the reference stage says (GE graph mode, static shapes)."""
from __future__ import annotations

from aspc.backends.ascend.megatron_model import arch_of, build_gpt, compile_forward, load_checkpoint


def reference_stage(stages: list[dict], train: dict) -> dict | None:
    """The plan's `reference` launch stage (its checkpoint directory: the reference model's; for
    frozen(actor), the actor's), or None without one. The frozen reference is built in the trainer's
    processes, on its parallel layout, so it must have the policy's architecture."""
    found = next((s for s in stages if s["kind"] == "reference"), None)
    if found is None:
        return None
    if arch_of(found) != arch_of(train):
        raise ValueError(f"stage '{found['stage']}': the reference model's architecture differs from the "
                         "policy's; the NPU trainer builds its frozen reference on the policy's ranks and layout: "
                         "use frozen(<policy model>) or a checkpoint of the same architecture")
    return found


def frozen_reference(stage: dict, rank_args: dict, reference: dict | None):
    """The reference policy on this rank (every rank builds it, in the same order): a second GPTModel
    of the train stage, eval mode, no gradients, loaded from the `reference` launch stage's checkpoint
    (verl's megatron reference policy) and compiled with torchair where that stage carries a
    `compiler` config; None without a reference stage."""
    if reference is None:
        return None
    model = load_checkpoint(build_gpt(stage, rank_args), stage, reference["builders"]["checkpoint"]).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return compile_forward(model, reference["compiler"]) if reference.get("compiler") else model
