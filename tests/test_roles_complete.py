"""Every attribute a driver uses on a backend's executors (the factory of aspc/roles.py, the
simulator's pricing) is declared in aspc/roles.py: collected statically from aspc/drivers/**.py, so
a driver that starts calling something undeclared fails here, not on the first backend without it."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DRIVERS = ROOT / "aspc" / "drivers"
ROLES = ROOT / "aspc" / "roles.py"
HOLDERS = ("executors", "pricing")  # the names a driver keeps a backend's executors under
WRAPPER = "_LearnerInActor"  # aspc/drivers/ray/runtime.py: the Ray driver's own wrapper of the executors


def _holds_executors(node: ast.expr) -> bool:
    """`executors`, `pricing`, `self.executors`, `runtime.executors`, ..."""
    if isinstance(node, ast.Name):
        return node.id in HOLDERS
    return isinstance(node, ast.Attribute) and node.attr in HOLDERS


def used_names(source: str) -> set[str]:
    """The attributes read on the executors: `executors.NAME` and getattr(executors, "NAME", ...)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _holds_executors(node.value):
            found.add(node.attr)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
                and len(node.args) >= 2 and _holds_executors(node.args[0]) \
                and isinstance(node.args[1], ast.Constant):
            found.add(node.args[1].value)
    return found


def declared_names(source: str, classes: str | None = None) -> set[str]:
    """Methods and annotated attributes of the classes in `source` (only `classes`, if named), and
    the attributes their methods assign to self."""
    found = set()
    for cls in ast.walk(ast.parse(source)):
        if not isinstance(cls, ast.ClassDef) or classes not in (None, cls.name):
            continue
        for item in ast.walk(cls):
            if isinstance(item, ast.FunctionDef):
                found.add(item.name)
            elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                found.add(item.target.id)
            elif isinstance(item, ast.Attribute) and isinstance(item.ctx, ast.Store) \
                    and isinstance(item.value, ast.Name) and item.value.id == "self":
                found.add(item.attr)
    return found


def driver_uses() -> dict[str, set[str]]:
    return {str(path.relative_to(ROOT)): used_names(path.read_text()) for path in sorted(DRIVERS.rglob("*.py"))}


def test_every_name_the_drivers_use_is_declared_in_the_roles():
    declared = declared_names(ROLES.read_text())
    wrapper = declared_names((DRIVERS / "ray" / "runtime.py").read_text(), WRAPPER)
    undeclared = {path: sorted(names - declared - wrapper) for path, names in driver_uses().items()}
    assert {path: names for path, names in undeclared.items() if names} == {}


def test_the_collector_sees_the_drivers_calls():
    """The scan finds what the drivers are known to call, the Ray driver's Ascend capability included."""
    used = set().union(*driver_uses().values())
    assert {"generation_engine", "trainer", "save_checkpoint", "learner_in_actor", "unstarted_engine",
            "join_trainer_side", "move_instance", "work", "cores"} <= used


def test_an_undeclared_call_is_reported():
    source = "def f(self, executors):\n    self.executors.warp_drive()\n    getattr(executors, 'hyperspace', None)\n"
    assert used_names(source) - declared_names(ROLES.read_text()) == {"warp_drive", "hyperspace"}


def test_the_wrapper_adds_only_its_own_parts():
    """What the Ray driver reads on its wrapper beyond the roles: the remote learner and the pool switch."""
    wrapper = declared_names((DRIVERS / "ray" / "runtime.py").read_text(), WRAPPER)
    assert "switch" in wrapper  # a name Pricing declares too: the union of the roles' names is what is checked
    assert wrapper - declared_names(ROLES.read_text()) - {"__init__", "__getattr__"} == {"inner", "learner"}
