"""Every name the Ascend launch plans and executors hand to vLLM, vllm-ascend, megatron-core, HCCL and
MindSpeed exists there. The vLLM 0.23.0, vllm-ascend 0.23.0 and megatron-core 0.12.1 (MindSpeed's
megatron) wheels are read as source, never installed (tests/wheel_sources.py); megatron-core 0.16.1
is installed as a test dependency and builds the configs and layer specs; HCCL variables and
MindSpeed flags are checked against the documented lists in tests/ascend_conformance/ (each with
its source). All bundled pipelines are lowered and checked."""
import ast
import dataclasses
import inspect
from functools import cache
from pathlib import Path

import pytest
import torch

from aspc.backends.ascend.lowering import lower
from aspc.cli.toolchain import compile_with_passes
from conftest import ROOT
from wheel_sources import (Sources, accepts_any_keyword, dataclass_fields, dict_keys, parameters,
                           string_arguments, wheel)

PIPELINES = sorted(p.stem for p in (ROOT / "pipelines").glob("*.aspl"))
DOCUMENTED = ROOT / "tests" / "ascend_conformance"
NPU_PACKAGES = ("vllm", "vllm_ascend", "megatron", "torchair")


@cache
def launch(name):
    path = ROOT / "pipelines" / f"{name}.aspl"
    return lower(compile_with_passes(path).plan(), path.parent)


def stack_sources(package: str) -> Sources:
    """One package of the NPU stack, read from its wheel (never installed)."""
    if package == "vllm":
        return Sources.from_wheel(wheel("ASPC_VLLM_WHEEL", "vllm==0.23.0"), ("vllm",))
    if package == "vllm_ascend":
        return Sources.from_wheel(wheel("ASPC_VLLM_ASCEND_WHEEL", "vllm-ascend==0.23.0", "manylinux_2_34_x86_64"),
                                  ("vllm_ascend",))
    if package == "megatron":  # MindSpeed's megatron-core
        return Sources.from_wheel(wheel("ASPC_MEGATRON_WHEEL", "megatron-core==0.12.1"), ("megatron",))
    # torchair as torch-npu 2.10.0 ships it (torch_npu/dynamo/torchair), imported as `torchair`
    return Sources.from_wheel(wheel("ASPC_TORCH_NPU_WHEEL", "torch-npu==2.10.0"), ("torchair",),
                              under="torch_npu/dynamo/")


@pytest.fixture(scope="module")
def vllm():
    return stack_sources("vllm")


@pytest.fixture(scope="module")
def vllm_ascend():
    return stack_sources("vllm_ascend")


@pytest.fixture(scope="module")
def torchair():
    return stack_sources("torchair")


@pytest.fixture(scope="module")
def megatron_012():
    return stack_sources("megatron")


def engines(name):
    return [s for s in launch(name).stages if s.role == "vllm-engine"]


def megatron_stages(name):
    return [s for s in launch(name).stages if s.role.startswith("megatron")]


def documented(filename: str) -> set[str]:
    lines = (DOCUMENTED / filename).read_text().splitlines()
    return {line.split()[0] for line in lines if line.strip() and not line.startswith("#")}


# ---- vLLM and vllm-ascend ----
def test_routing_replays_engine_argument_and_output_field_are_vllm_0_23s(vllm):
    """routing_replay's engine argument (engine_args.py) and what VllmEngine._routes reads; no bundled
    pipeline replays routes, so the per-pipeline check below does not see them."""
    assert "enable_return_routed_experts" in dataclass_fields(vllm, "vllm.engine.arg_utils", "EngineArgs")
    assert "routed_experts" in dataclass_fields(vllm, "vllm.outputs", "CompletionOutput")


@pytest.mark.parametrize("name", PIPELINES)
def test_engine_arguments_are_vllm_engine_args_fields(vllm, name):
    fields = dataclass_fields(vllm, "vllm.engine.arg_utils", "EngineArgs")
    compilation = dataclass_fields(vllm, "vllm.config.compilation", "CompilationConfig")
    transfer = dataclass_fields(vllm, "vllm.config.weight_transfer", "WeightTransferConfig")
    for stage in engines(name):
        assert set(stage.config) <= fields, f"{stage.stage}: not EngineArgs fields: {set(stage.config) - fields}"
        assert set(stage.config.get("compilation_config", {})) <= compilation
        assert set(stage.config.get("weight_transfer_config", {})) <= transfer
        assert "data_parallel_size" not in stage.config  # LLM(data_parallel_size>1) raises; VLLM_DP_* instead


def additional_config_keys(sources: Sources) -> set[str]:
    """Keys vllm-ascend reads from additional_config: `.get("k")` and `_get_config_value(additional_config, "k")`."""
    keys = string_arguments(sources, "additional_config", "get")
    for tree in sources.trees_with("_get_config_value("):
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "_get_config_value"
                    and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)):
                keys.add(node.args[1].value)
    return keys


@pytest.mark.parametrize("name", PIPELINES)
def test_additional_config_keys_and_transfer_backends_exist_in_vllm_ascend(vllm, vllm_ascend, name):
    keys = additional_config_keys(vllm_ascend)
    backends = string_arguments(vllm_ascend, "WeightTransferEngineFactory", "register_engine") | \
        string_arguments(vllm, "WeightTransferEngineFactory", "register_engine")
    for stage in engines(name):
        assert set(stage.config.get("additional_config", {})) <= keys
        if "weight_transfer_config" in stage.config:
            assert stage.config["weight_transfer_config"]["backend"] in backends


@pytest.mark.parametrize("name", PIPELINES)
def test_weight_refresh_calls_are_llm_methods(vllm, name):
    methods = vllm.members("LLM")
    for stage in engines(name):
        refresh = stage.micro_batching["weight_refresh"] or {"calls": []}
        calls = [c if isinstance(c, str) else c["call"] for c in refresh["calls"]]
        calls += [refresh["sleep"]["call"]] if "sleep" in refresh else []
        assert set(calls) <= methods, f"not methods of vllm.LLM: {set(calls) - methods}"


@pytest.mark.parametrize("name", PIPELINES)
def test_vllm_environment_variables_exist(vllm, vllm_ascend, name):
    known = dict_keys(vllm, "vllm.envs", "environment_variables") | dict_keys(vllm_ascend, "vllm_ascend.envs",
                                                                              "env_variables")
    names = {k for p in launch(name).processes for k in p.env if k.startswith("VLLM")}
    assert names <= known, f"not vLLM / vllm-ascend variables: {names - known}"


@pytest.mark.parametrize("name", PIPELINES)
def test_hccl_variables_are_documented(name):
    known = documented("hccl_env.txt")
    names = {k for p in launch(name).processes for k in p.env if k.startswith("HCCL")}
    assert names <= known, f"not in CANN's environment-variable reference: {names - known}"


# ---- megatron-core and MindSpeed ----
def _installed_fields(class_name: str) -> set[str]:
    from megatron.core.transformer import transformer_config

    return {f.name for f in dataclasses.fields(getattr(transformer_config, class_name))}


@pytest.mark.parametrize("name", PIPELINES)
def test_megatron_config_fields_exist_in_both_megatron_versions(megatron_012, name):
    pytest.importorskip("megatron.core")
    for stage in megatron_stages(name):
        cls = stage.builders["config_class"]
        old = dataclass_fields(megatron_012, "megatron.core.transformer.transformer_config", cls)
        for version, fields in (("0.12.1", old), ("0.16.1", _installed_fields(cls))):
            unknown = set(stage.config) - fields
            assert not unknown, f"{stage.stage}: not {cls} fields in megatron-core {version}: {unknown}"


@pytest.mark.parametrize("name", PIPELINES)
def test_gpt_model_and_layer_spec_arguments_exist_in_both_megatron_versions(megatron_012, name):
    pytest.importorskip("megatron.core")
    from megatron.core.models.gpt import GPTModel, gpt_layer_specs

    model_params = set(inspect.signature(GPTModel.__init__).parameters)
    [old_model] = [f for f in megatron_012.functions("__init__")
                   if f in megatron_012.class_in("megatron.core.models.gpt.gpt_model", "GPTModel").body]
    for stage in megatron_stages(name):
        ranks = [p for p in launch(name).processes if p.stage == stage.stage]
        per_rank = {k for p in ranks for k in p.model_args}
        assert not per_rank & set(stage.model_args)  # GPTModel(**model_args, **rank_args): no keyword twice
        args = set(stage.model_args) | per_rank
        assert args <= model_params and args <= parameters(old_model)
        spec = stage.builders["layer_spec"]
        [old_spec] = megatron_012.functions(spec["function"])
        assert set(spec["arguments"]) <= set(inspect.signature(getattr(gpt_layer_specs, spec["function"])).parameters)
        assert set(spec["arguments"]) <= parameters(old_spec)


@pytest.mark.parametrize("name", ["grpo_30b_moe", "r1_zero_671b", "grpo_7b"])
def test_layer_specs_build_moe_mla_and_rmsnorm_layers(name):
    """The lowered config and layer spec give routed experts to MoE layers, MLA attention to DeepSeek,
    q/k norm to Qwen3 and RMSNorm everywhere (the bare local spec gave dense MLPs and LayerNorm)."""
    pytest.importorskip("megatron.core")
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer import transformer_config
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import build_module

    from aspc.backends.ascend.executors import materialize

    stage = megatron_stages(name)[0]
    config = getattr(transformer_config, stage.builders["config_class"])(**materialize(stage.config),
                                                                         use_cpu_initialization=True)
    spec = stage.builders["layer_spec"]
    built = getattr(gpt_layer_specs, spec["function"])(
        **({"config": config, "pp_rank": 0} if "block" in spec["function"] else {}), **spec["arguments"])
    layers = built.layer_specs if hasattr(built, "layer_specs") else [built]
    last = layers[-1].submodules
    assert (last.mlp.module is MoELayer) == bool(config.num_moe_experts)
    assert ("MLA" in last.self_attention.module.__name__) == bool(getattr(config, "multi_latent_attention", False))
    # megatron's torch norm refuses sequence parallelism; on the NPU MindSpeed replaces it with its PTNorm
    # (mindspeed/core/megatron_basic/megatron_basic.py), which takes the same config and supports it
    plain = dataclasses.replace(config, sequence_parallel=False)
    norm = build_module(last.input_layernorm, config=plain, hidden_size=config.hidden_size,
                        eps=config.layernorm_epsilon)
    assert isinstance(norm, torch.nn.RMSNorm) and norm.eps == config.layernorm_epsilon
    if config.qk_layernorm:
        assert last.self_attention.submodules.q_layernorm is not None


@pytest.mark.parametrize("name", PIPELINES)
def test_pipeline_stages_split_every_layer_once(name):
    pytest.importorskip("megatron.core")
    from megatron.core.models.gpt.gpt_layer_specs import get_num_layers_to_build
    from megatron.core.transformer import transformer_config

    from aspc.backends.ascend.executors import materialize

    for stage in megatron_stages(name):
        cls = getattr(transformer_config, stage.builders["config_class"])
        config = cls(**materialize(stage.config), use_cpu_initialization=True)
        pp = config.pipeline_model_parallel_size
        assert sum(get_num_layers_to_build(config, pp_rank=r) for r in range(pp)) == config.num_layers
        firsts = [p.model_args["pre_process"] for p in launch(name).processes if p.stage == stage.stage]
        assert firsts.count(True) == len(firsts) // pp  # one pipeline stage in pp embeds


@pytest.mark.parametrize("name", PIPELINES)
def test_mindspeed_flags_are_documented(name):
    known = documented("mindspeed_flags.txt")
    for stage in megatron_stages(name):
        flags = {a for a in stage.builders["mindspeed_argv"] if a.startswith("--")}
        assert flags <= known, f"not MindSpeed / Megatron-LM flags: {flags - known}"
        if stage.config["context_parallel_size"] > 1:
            assert "--context-parallel-algo" in flags


# ---- what the executors call ----
def npu_sources(vllm, vllm_ascend, megatron_012, torchair) -> dict[str, Sources]:
    return {"vllm": vllm, "vllm_ascend": vllm_ascend, "megatron": megatron_012, "torchair": torchair}


def executor_files() -> list[Path]:
    """The Ascend backend's modules that import vLLM, vllm-ascend, megatron or torchair (inside functions)."""
    return [p for p in sorted((ROOT / "backends" / "ascend").glob("*.py"))
            if any(f"import {pkg}" in p.read_text() or f"from {pkg}" in p.read_text() for pkg in NPU_PACKAGES)]


def foreign_names(tree: ast.Module) -> dict[str, tuple[str, str]]:
    """Local name -> (module, imported name) for `from vllm... / megatron... import X`; an imported
    package itself (`import torchair`) -> (package, "")."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in NPU_PACKAGES:
            for alias in node.names:
                names[alias.asname or alias.name] = (node.module, alias.name)
        if isinstance(node, ast.Import):
            names |= {alias.asname or alias.name: (alias.name, "") for alias in node.names
                      if alias.name.split(".")[0] in NPU_PACKAGES}
    return names


def unknown_names(tree: ast.Module, sources: dict[str, Sources]) -> list[str]:
    """Imported names that their module lacks; attributes used on imported modules/classes and on
    objects built from imported classes (`llm = LLM(...)`, `self._llm = api.LLM(...)` and a property
    returning it) that those lack; keywords their functions and methods do not take."""
    imported = foreign_names(tree)
    problems = [f"{module}.{name}" for module, name in imported.values()
                if name and not _module_has(sources[module.split(".")[0]], module, name)]
    instances = _instances(tree, imported)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            owner = imported.get(_dotted(node.value)) or instances.get(_dotted(node.value))
            if owner and not _has_attribute(sources[owner[0].split(".")[0]], owner, node.attr):
                problems.append(f"{owner[1] or owner[0]}.{node.attr}")
        if isinstance(node, ast.Call):
            problems += _unknown_keywords(node, imported, instances, sources)
            problems += _unknown_dict_keys(node, imported, instances, sources)
    return problems


def _module_has(sources: Sources, module: str, name: str) -> bool:
    return sources.defines(module, name) or f"{module}.{name}" in sources.texts


def _dotted(node) -> str:
    """`x` or `self.x`; "" for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return f"self.{node.attr}"
    return ""


def _instances(tree, imported) -> dict[str, tuple[str, str]]:
    """Names holding an object of an imported class: assigned from calling it (`LLM(...)`, or
    `api.LLM(...)` for an imported `LLM`), and properties returning such a `self.` attribute."""
    classes = {name: origin for name, origin in imported.items() if origin[1][:1].isupper()}
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            func = node.value.func
            called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            if called in classes:
                found |= {_dotted(t): classes[called] for t in node.targets if _dotted(t)}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and any(getattr(d, "id", "") == "property" for d in node.decorator_list):
            returned = {_dotted(n.value) for n in ast.walk(node) if isinstance(n, ast.Return) and n.value is not None}
            origin = next((found[r] for r in returned if r in found), None)
            if origin:
                found[f"self.{node.name}"] = origin
    return found


def _has_attribute(sources: Sources, owner: tuple[str, str], attr: str) -> bool:
    module, name = owner
    if not name:  # an imported package: torchair.get_npu_backend
        return sources.defines(module, attr)
    if f"{module}.{name}" in sources.texts:  # an imported module: parallel_state.initialize_model_parallel
        return sources.defines(f"{module}.{name}", attr)
    return attr in sources.members(name)


def _callees(call: ast.Call, imported, instances, sources) -> tuple[Sources | None, list[ast.FunctionDef]]:
    """The package and the definitions of the imported function, module function, class constructor
    or method called here (none when the call is not to an imported name)."""
    func = call.func
    owner = _dotted(func.value) if isinstance(func, ast.Attribute) else ""
    if owner in imported or owner in instances:
        module, _ = imported.get(owner) or instances[owner]
        package = sources[module.split(".")[0]]
        return package, package.functions(func.attr)
    if isinstance(func, ast.Name) and func.id in imported:
        module, name = imported[func.id]
        package = sources[module.split(".")[0]]
        return package, _constructors(package, name) if name[:1].isupper() else package.functions(name)
    return None, []


def _unknown_dict_keys(call: ast.Call, imported, instances, sources) -> list[str]:
    """Keys of a dict literal passed to an imported function that it never reads: each key must be a
    string the function's body names, or a field of the class it builds from that argument
    (`Args(**trainer_args)`: HCCLWeightTransferEngine.trainer_send_weights)."""
    package, candidates = _callees(call, imported, instances, sources)
    literal = [a for a in [*call.args, *(k.value for k in call.keywords)] if isinstance(a, ast.Dict)]
    keys = {k.value for d in literal for k in d.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    if not keys or not candidates:
        return []
    known = set()
    for function in candidates:
        for node in ast.walk(function):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                known.add(node.value)
            if isinstance(node, ast.Call) and any(k.arg is None for k in node.keywords):
                known |= package.members(getattr(node.func, "id", getattr(node.func, "attr", "")))
    return [f"{_dotted(call.func) or getattr(call.func, 'attr', '')}({{{k!r}: ...}})" for k in sorted(keys - known)]


def _unknown_keywords(call: ast.Call, imported, instances, sources) -> list[str]:
    """Keywords that the imported function, module function, class constructor or method called here lacks."""
    func = call.func
    _, candidates = _callees(call, imported, instances, sources)
    if not candidates or any(accepts_any_keyword(f) for f in candidates):
        return []
    allowed = set().union(*(parameters(f) for f in candidates))
    return [f"{func.attr if isinstance(func, ast.Attribute) else func.id}({k}=)"
            for k in sorted({k.arg for k in call.keywords if k.arg} - allowed)]


def _constructors(package: Sources, name: str, seen: frozenset = frozenset()) -> list[ast.FunctionDef]:
    """The __init__ of class `name` (or of the nearest base that has one)."""
    found = []
    for cls in package.classes(name):
        own = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"]
        bases = [getattr(b, "id", "") for b in cls.bases if getattr(b, "id", "") not in seen | {name, ""}]
        found += own or [f for b in bases for f in _constructors(package, b, seen | {name})]
    return found


# executors that run only on a newer megatron-core than the NPU install's, which refuses them before the run
# (routing_replay.py: RouterReplay, megatron-core 0.16 on): checked against the installed 0.16.1
ON_NEWER_MEGATRON = {"routing_replay.py"}


def test_executors_call_only_names_that_exist(vllm, vllm_ascend, megatron_012, torchair):
    files = executor_files()
    assert files, "the Ascend executors import vLLM and megatron somewhere"
    sources = npu_sources(vllm, vllm_ascend, megatron_012, torchair)
    newer = sources | {"megatron": Sources.installed("megatron")}
    problems = {p.name: unknown_names(ast.parse(p.read_text()), newer if p.name in ON_NEWER_MEGATRON else sources)
                for p in files}
    assert not any(problems.values()), f"names the real libraries lack: {problems}"


def test_the_checker_finds_a_renamed_method(vllm, vllm_ascend, megatron_012, torchair):
    source = ("def f():\n    from vllm import LLM\n    from megatron.core import parallel_state\n"
              "    llm = LLM(model='m')\n    llm.wake_up(tags=['weights'])\n    llm.reload_weights()\n"
              "    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, tensor_parallel=2)\n"
              "class Engine:\n    @property\n    def llm(self):\n        self._llm = self.api.LLM(model='m')\n"
              "        return self._llm\n    def sleep(self):\n        self.llm.sleep(levels=1)\n"
              "        self.llm.update_weight({})\n")
    source += ("def g():\n    import torchair\n    torchair.get_npu_backends()\n"
               "    from vllm_ascend.distributed.weight_transfer.hccl_engine import HCCLWeightTransferEngine\n"
               "    HCCLWeightTransferEngine.trainer_send_weights([], {'group': None, 'source': 0})\n")
    problems = unknown_names(ast.parse(source), npu_sources(vllm, vllm_ascend, megatron_012, torchair))
    assert sorted(problems) == ["LLM.reload_weights", "LLM.update_weight",
                                "initialize_model_parallel(tensor_parallel=)", "sleep(levels=)",
                                "torchair.get_npu_backends", "trainer_send_weights({'source': ...})"]
