"""A trainer rank's megatron weights from a Hugging Face checkpoint directory (safetensors, one file or
sharded with `model.safetensors.index.json`), read lazily: only the tensors of this rank's pipeline
stage and expert-parallel rank are opened (`safetensors.safe_open`), each mapped to its megatron name
(reshard.py: fused QKV interleaved per query group, [gate; up] for fc1), cut for this tensor-parallel
rank and copied in place into the model's parameters (their device and dtype).

As verl's megatron loader (verl/models/mcore/loader.py) and MindSpeed-RL's HF -> mcore conversion do,
every parameter of the rank must be filled; the exceptions are a critic's value head (freshly
initialised, as verl's value model) and, on the last pipeline stage of a tied model, the output layer,
which is the embedding's copy. Checkpoint tensors megatron has no parameter for are skipped: rotary
`inv_freq` buffers, `lm_head.weight` of a tied model (or of a critic's causal-LM body), a critic
checkpoint's `score.*` read by a policy, and layers past the model's (DeepSeek-V3's multi-token
prediction layer 61)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from aspc.backends.ascend import reshard

INDEX = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint directory that does not hold this model's weights; the message says which."""


def tensor_files(checkpoint_dir) -> dict[str, Path]:
    """Hugging Face tensor name -> the safetensors file that holds it."""
    from safetensors import safe_open

    folder = Path(checkpoint_dir)
    index = folder / INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors files (nor {INDEX}); the NPU trainer loads Hugging "
                              "Face safetensors checkpoints")
    found = {}
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            found |= {name: path for name in handle.keys()}
    return found


class LazyCheckpoint:
    """Reads one tensor at a time from the files that hold it (each file opened once, memory-mapped)."""

    def __init__(self, checkpoint_dir):
        self.folder, self.files = Path(checkpoint_dir), tensor_files(checkpoint_dir)
        self.handles: dict[Path, object] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        path = self.files.get(name)
        if path is None:
            raise CheckpointError(f"{self.folder}: the checkpoint has no tensor '{name}' (looked in "
                                  f"{', '.join(sorted({p.name for p in self.files.values()}))}); is it this "
                                  "model's checkpoint?")
        if path not in self.handles:
            self.handles[path] = safe_open(str(path), framework="pt")
        return self.handles[path].get_tensor(name)


def rank_tensors(arch, hf, parallel, layout: reshard.Layout, coords: dict) -> dict[str, torch.Tensor]:
    """This rank's state dict (local names, its tensor-parallel cut) from the checkpoint `hf` (a
    mapping read on demand): what reshard.shard_state keeps of the whole model, read for this rank only."""
    out = {}
    per_rank = arch.experts // parallel.ep if arch.experts else 0
    for name, cut in reshard.full_params(arch, layout).items():
        if layout.value_head and name == "output_layer.weight":
            continue  # the critic's value head stays freshly initialised (verl)
        if reshard.stage_of(arch, name, parallel.pp, layout) != coords["pp"]:
            continue
        expert = reshard.expert_of(name)
        if expert is not None and expert // per_rank != coords["ep"]:
            continue
        tensor = reshard.param_from_hf(arch, name, hf, layout)
        out[reshard.local_name(arch, name, parallel.pp, parallel.ep, layout)] = \
            reshard.split(tensor, cut, parallel.tp)[coords["tp"]]
    if arch.tied and coords["pp"] == parallel.pp - 1 and parallel.pp > 1:
        # the last stage's output layer is the embedding's copy (megatron zero-fills it, then all-reduces)
        out["output_layer.weight"] = reshard.split(hf[reshard.TOP["embedding.word_embeddings.weight"]],
                                                   reshard.COLUMN, parallel.tp)[coords["tp"]]
    return out


def unread(arch, names, layout: reshard.Layout) -> list[str]:
    """Checkpoint tensors that no megatron parameter is made of and that are not one of the known
    extras (module docstring): a sign of another model's checkpoint."""
    used = {s for name in reshard.full_params(arch, layout) for s in reshard.hf_sources(arch, name, layout)}
    return sorted(n for n in names if n not in used and not _known_extra(arch, n, layout))


def _known_extra(arch, name: str, layout: reshard.Layout) -> bool:
    if name.endswith("rotary_emb.inv_freq") or name.startswith(reshard.VALUE_HEAD.split(".")[0] + "."):
        return True
    if name == reshard.TOP["output_layer.weight"]:
        return arch.tied or layout.value_head
    parts = name.split(".")
    return name.startswith("model.layers.") and int(parts[2]) >= arch.layers  # DeepSeek-V3's MTP layer


def fresh(name: str, layout: reshard.Layout) -> bool:
    """Parameters that keep their initial values: a critic's value head (weight and bias)."""
    return layout.value_head and name.startswith("output_layer.")


@torch.no_grad()
def load_rank_weights(model, checkpoint_dir, arch, parallel, layout: reshard.Layout, coords: dict) -> list[str]:
    """Copy this rank's share of the checkpoint into `model` (a GPTModel, not DDP-wrapped) in place;
    `coords`: its "tp", "pp" and "ep" ranks. Returns the names filled. Raises CheckpointError for a
    missing tensor, a shape that differs, or a parameter nothing fills."""
    state = {k: v for k, v in model.state_dict(keep_vars=True).items() if isinstance(v, torch.Tensor)}
    checkpoint = LazyCheckpoint(checkpoint_dir)
    extra = unread(arch, checkpoint.files, layout)
    if extra:
        raise CheckpointError(f"{checkpoint_dir}: tensors this model has no parameter for, e.g. {extra[:5]} "
                              f"({len(extra)} in all): is it this model's checkpoint?")
    loaded = rank_tensors(arch, checkpoint, parallel, layout, coords)
    if any(name.endswith("mlp.experts.weight1") for name in state):  # moe_grouped_gemm: GroupedMLP
        loaded = reshard.sequential_to_grouped(arch, loaded, parallel.ep)
    unfilled = sorted(n for n in state if n not in loaded and not fresh(n, layout) and not n.endswith("_extra_state"))
    unknown = sorted(n for n in loaded if n not in state)
    if unfilled or unknown:
        raise CheckpointError(f"{checkpoint_dir}: the checkpoint does not match this rank's megatron model "
                              f"(coords {coords}): parameters left unfilled {unfilled[:5]}, mapped tensors the "
                              f"model lacks {unknown[:5]}")
    for name, tensor in loaded.items():
        target = state[name]
        if tuple(target.shape) != tuple(tensor.shape):
            raise CheckpointError(f"{checkpoint_dir}: '{name}' is {tuple(tensor.shape)} in the checkpoint but "
                                  f"{tuple(target.shape)} in the model: is it this model's checkpoint?")
        target.data.copy_(tensor.to(dtype=target.dtype))
    return sorted(loaded)


def parallel_coords() -> dict:
    """This process's tensor-, pipeline- and expert-parallel ranks from megatron's parallel state."""
    from megatron.core import parallel_state

    return {"tp": parallel_state.get_tensor_model_parallel_rank(),
            "pp": parallel_state.get_pipeline_model_parallel_rank(),
            "ep": parallel_state.get_expert_model_parallel_rank()}
