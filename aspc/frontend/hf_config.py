"""`model NAME = hf("DIR")`: a Hugging Face checkpoint directory's config.json -> the model's
shape (ModelArch) and dtype, at compile time. Only config.json is read (no weights, no
transformers), so `aspc check` stays fast; what the CPU backend cannot run is refused here."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from aspc.ir.facts import ModelArch

ARCHITECTURES = ("qwen2", "qwen3", "qwen3_moe", "llama")  # config.json model_type values the CPU decoder runs
DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class HfConfigError(Exception):
    """The directory cannot be used: a message and a hint."""

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.message, self.hint = message, hint


@dataclass(frozen=True)
class HfModel:
    arch: ModelArch
    dtype: str  # bf16 | fp16 | fp32, from config.json
    warnings: tuple[tuple[str, str], ...]  # (message, hint): what `aspc run` will need


def read_hf_model(directory: Path) -> HfModel:
    config = _read_config(directory)
    _check_supported(config)
    return HfModel(_arch(config), DTYPES.get(config.get("torch_dtype") or config.get("dtype"), "fp32"),
                   _missing_files(directory))


def _read_config(directory: Path) -> dict:
    if not directory.is_dir():
        raise HfConfigError(f"checkpoint directory '{directory}' does not exist",
                            "give a folder written by save_pretrained, relative to the .aspl file")
    try:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise HfConfigError(f"'{directory}' has no config.json",
                            "a Hugging Face checkpoint directory holds config.json, safetensors weights "
                            "and tokenizer files") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise HfConfigError(f"{directory / 'config.json'} is not readable JSON ({type(error).__name__})") from None
    if not isinstance(config, dict):
        raise HfConfigError(f"{directory / 'config.json'} is not a JSON object")
    return config


def _check_supported(config: dict) -> None:
    kind = config.get("model_type")
    if kind not in ARCHITECTURES:
        raise HfConfigError(f"model_type {kind!r} is not supported",
                            "the CPU backend runs " + ", ".join(ARCHITECTURES) + " checkpoints")
    problems = [why for bad, why in (
        (config.get("hidden_act", "silu") != "silu", f"hidden_act {config.get('hidden_act')!r} (silu only)"),
        (_rope_type(config) != "default", f"rope scaling {_rope_type(config)!r} (plain RoPE only)"),
        (bool(config.get("attention_bias")), "attention_bias (an output-projection bias)"),
        (bool(config.get("mlp_bias")), "mlp_bias"),
        (bool(config.get("use_sliding_window")), "sliding-window attention"),
        (bool(config.get("mlp_only_layers")), "mlp_only_layers (dense layers among the experts)"),
        (config.get("decoder_sparse_step", 1) != 1, "decoder_sparse_step (experts in every k-th layer only)"),
    ) if bad]
    if problems:
        raise HfConfigError(f"this {kind} checkpoint uses " + ", ".join(problems) + ", which the CPU "
                            "backend's decoder does not implement", "use a checkpoint without it")


def _rope_type(config: dict) -> str:
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    return rope.get("rope_type") or rope.get("type") or "default"


def _rope_theta(config: dict) -> float:
    return float(config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta") or 10000.0)


def _arch(config: dict) -> ModelArch:
    arch = _read_arch(config)
    if arch.heads % arch.kv_heads:
        raise HfConfigError(f"config.json: {arch.heads} attention heads are not a multiple of "
                            f"{arch.kv_heads} key/value heads")
    return arch


def _read_arch(config: dict) -> ModelArch:
    try:
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        return ModelArch(
            layers=int(config["num_hidden_layers"]), hidden=hidden, heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads), ffn=int(config["intermediate_size"]),
            vocab=int(config["vocab_size"]), tied=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=config["model_type"] == "qwen2", max_seq=int(config.get("max_position_embeddings", 4096)),
            rope_theta=_rope_theta(config), norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            qk_norm=config["model_type"] in ("qwen3", "qwen3_moe"), **_experts(config))
    except ZeroDivisionError:
        raise HfConfigError("config.json has num_attention_heads = 0") from None
    except KeyError as error:
        raise HfConfigError(f"config.json lacks {error.args[0]!r}") from None
    except (TypeError, ValueError) as error:
        raise HfConfigError(f"config.json has a value of the wrong type ({error})") from None


def _experts(config: dict) -> dict:
    """A Qwen3-MoE config's routed experts (transformers 5 saves num_experts as num_local_experts)."""
    if config["model_type"] != "qwen3_moe":
        return {}
    experts = int(config.get("num_experts") or config["num_local_experts"])
    return {"experts": experts, "top_k": int(config["num_experts_per_tok"]),
            "expert_ffn": int(config["moe_intermediate_size"]), "norm_topk": bool(config.get("norm_topk_prob"))}


def _missing_files(directory: Path) -> tuple[tuple[str, str], ...]:
    found = []
    if not any((directory / name).exists() for name in WEIGHT_FILES):
        found.append((f"'{directory}' has no safetensors weights (model.safetensors or its index)",
                      "`aspc run` needs them; compile and simulate do not"))
    if not any((directory / name).exists() for name in TOKENIZER_FILES):
        found.append((f"'{directory}' has no tokenizer files (tokenizer.json, tokenizer_config.json)",
                      "`aspc run` needs them; compile and simulate do not"))
    return tuple(found)
