"""Hugging Face checkpoint weights <-> the CPU decoder (model.py): parameter names both ways,
loading safetensors (one file or an index of shards), and writing a trained model back as a
checkpoint directory that transformers and vLLM load: config.json (the source's, with the export
dtype), model.safetensors (Hugging Face names, in that dtype) and every other file of the source
(tokenizer, chat template, generation config) copied unchanged."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from aspc.rl.hf_tokenizer import HfError
from aspc.backends.cpu.model import TORCH_DTYPES, TinyQwen
from aspc.ir.facts import ModelArch

_TOP = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "head.weight": "lm_head.weight"}
_LAYER = {  # within blocks.N. (ours) and model.layers.N. (theirs)
    "attn_norm.weight": "input_layernorm.weight", "mlp_norm.weight": "post_attention_layernorm.weight",
    "attn.q_norm.weight": "self_attn.q_norm.weight", "attn.k_norm.weight": "self_attn.k_norm.weight",
    **{f"attn.{p}.{kind}": f"self_attn.{p}_proj.{kind}" for p in "qkvo" for kind in ("weight", "bias")},
    **{f"mlp.{p}.weight": f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")},
    "mlp.router.weight": "mlp.gate.weight",  # Qwen3-MoE's router
}
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)\.weight$")  # one expert's SwiGLU, as a checkpoint stores it
CONFIG_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
_NOT_COPIED = re.compile(r"^(config\.json|(model|pytorch_model).*\.(safetensors|bin)(\.index\.json)?)$")


def hf_name(name: str) -> str:
    """Our parameter name -> the Hugging Face one (Qwen2, Qwen3, Qwen3-MoE and Llama share the scheme)."""
    if name in _TOP:
        return _TOP[name]
    _, layer, rest = name.split(".", 2)  # blocks.N.rest
    expert = _EXPERT.match(rest)
    if expert:
        return f"model.layers.{layer}.mlp.experts.{expert[1]}.{expert[2]}_proj.weight"
    return f"model.layers.{layer}.{_LAYER[rest]}"


def to_hf(state: dict) -> dict:
    """A decoder's state dict under Hugging Face names (a critic's value head is not part of it)."""
    return {hf_name(k): v for k, v in state.items() if not k.startswith("value.")}


def load_hf_model(arch: ModelArch, directory: Path, seed: int = 0, value_head: bool = False) -> TinyQwen:
    """The decoder with the checkpoint's weights (in fp32); a value head stays as initialised."""
    model = TinyQwen(arch, seed=seed, value_head=value_head)
    tensors = read_weights(directory)
    wanted = {hf_name(k): k for k in model.state_dict() if not k.startswith("value.")}
    missing = [name for name in wanted if name not in tensors]
    if missing:
        raise HfError(f"{directory}: the weights lack {missing[0]}" + (f" and {len(missing) - 1} more"
                                                                        if len(missing) > 1 else "")
                      + "; is config.json from the same checkpoint?")
    state = {ours: tensors[theirs].to(torch.float32) for theirs, ours in wanted.items()}
    try:
        model.load_state_dict(state, strict=False)
    except RuntimeError as error:
        raise HfError(f"{directory}: the weights do not fit config.json: {str(error).splitlines()[-1].strip()}") \
            from None
    return model


def read_weights(directory: Path) -> dict:
    """Every tensor of model.safetensors, or of the shards that model.safetensors.index.json names."""
    index = directory / "model.safetensors.index.json"
    try:
        if index.exists():
            files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
            return {k: v for f in files for k, v in load_file(str(directory / f)).items()}
        return load_file(str(directory / "model.safetensors"))
    except FileNotFoundError as error:
        raise HfError(f"{directory}: no safetensors weights ({Path(error.filename or 'model.safetensors').name} "
                      "is missing); save the checkpoint with save_pretrained(safe_serialization=True)") from None
    except (OSError, KeyError, ValueError) as error:
        raise HfError(f"{directory}: cannot read the weights: {type(error).__name__}: {error}") from None


def export_hf(state: dict, source: Path, out: Path, dtype: str) -> Path:
    """Write `state` (our names) as a checkpoint directory shaped like `source`, in `dtype`."""
    out.mkdir(parents=True, exist_ok=True)
    for file in sorted(source.iterdir()):
        if file.is_file() and not _NOT_COPIED.match(file.name):
            shutil.copy2(file, out / file.name)
    config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    config["torch_dtype" if "torch_dtype" in config else "dtype"] = CONFIG_DTYPES[dtype]
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    tensors = {k: v.detach().to(TORCH_DTYPES[dtype]).contiguous() for k, v in to_hf(state).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
