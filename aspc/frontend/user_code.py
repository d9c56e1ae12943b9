"""Python code a pipeline names (`python = "module:function"` in rewards and tools): where it is found.

A module is looked up in the folder of the .aspl file first, as Python looks in a script's folder,
then among the installed modules. `aspc check` imports it to find the function, and the runtime
loads it the same way, so a module beside the .aspl works without setting PYTHONPATH.

A lookup of a module that is already imported for this folder (or installed) returns it without
touching the search path, as Python itself would. Python's import caches (the directory listings
of sys.path) are cleared at the first search in a folder, so a module written after the process
started is found the first time it is asked for; a search that misses later in the same folder
clears them again and searches once more, so a module written after an earlier lookup there is
found too. Clearing them for every lookup made a check of many modules quadratic (issue 37).
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from collections.abc import Callable

from aspc.frontend.diagnostics import did_you_mean

_LOADED: dict[str, str] = {}  # top-level module name -> the folder we loaded it from
_SEARCHED: set[str] = set()  # folders whose first search cleared the import caches


class UserCodeError(Exception):
    """A module or function a pipeline names cannot be loaded; `hint` says what to do."""

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.message, self.hint = message, hint


def load_function(spec: str, base_dir: Path | None) -> Callable:
    """The function of "module:function", the module looked up beside the .aspl file first."""
    module_name, _, function = spec.partition(":")
    module = load_module(module_name, base_dir)
    found = getattr(module, function, None)
    if not callable(found):
        raise UserCodeError(f"module '{module_name}' ({_origin(module)}) has no function '{function}'",
                            _function_hint(module, function))
    return found


def load_module(name: str, base_dir: Path | None) -> ModuleType:
    """The module, imported with `base_dir` first on the search path; UserCodeError if it fails."""
    top = name.partition(".")[0]
    folder = str(Path(base_dir).resolve()) if base_dir is not None else None
    _forget_if_from_elsewhere(top, folder)
    module = _imported(name) or _search(name, folder)
    if module is None:
        raise UserCodeError(f"cannot find Python module '{name}'", _where_hint(name, base_dir))
    _remember(top, folder)
    return module


def _imported(name: str) -> ModuleType | None:
    """The module if it is imported already: a search would return it without reading the search
    path (find_spec and import_module look in sys.modules first)."""
    module = sys.modules.get(name)
    if module is None or getattr(module, "__spec__", None) is None:
        return None  # the search reports these as not found
    return module


def _search(name: str, folder: str | None) -> ModuleType | None:
    """The module imported with the .aspl's folder first on the search path; None if not found."""
    if folder is None:
        return _find_and_import(name, cleared=True)
    sys.path.insert(0, folder)
    try:
        return _find_and_import(name, cleared=_clear_at_first_search(folder))
    finally:
        sys.path.remove(folder)


def _clear_at_first_search(folder: str) -> bool:
    """Whether the import caches were cleared now: the module may have been written after this
    process started (or listed the folder)."""
    if folder in _SEARCHED:
        return False
    importlib.invalidate_caches()
    _SEARCHED.add(folder)
    return True


def _find_and_import(name: str, cleared: bool) -> ModuleType | None:
    spec = _find(name)
    if spec is None and not cleared:  # written since the folder's first search, perhaps
        importlib.invalidate_caches()
        spec = _find(name)
    return _import(name) if spec is not None else None


def _forget_if_from_elsewhere(top: str, folder: str | None) -> None:
    """A module of the same name that we loaded for another .aspl folder is dropped, so that each
    pipeline gets the module beside it (never an installed module: those stay)."""
    if top not in _LOADED or _LOADED[top] == folder:
        return
    for name in [n for n in sys.modules if n == top or n.startswith(top + ".")]:
        del sys.modules[name]
    del _LOADED[top]


def _remember(top: str, folder: str | None) -> None:
    module = sys.modules.get(top)
    if folder is None or module is None:
        return
    if _origin(module).startswith(folder):
        _LOADED[top] = folder


def _find(name: str):
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):  # a parent package is missing or broken
        return None
    except Exception as error:  # the parent package's own code raised
        raise UserCodeError(f"importing '{name}' failed: {type(error).__name__}: {error}",
                            f"`python -c 'import {name}'` in the .aspl file's folder shows the traceback") from None


def _import(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except BaseException as error:  # the user's module code: any failure is theirs to fix
        if isinstance(error, KeyboardInterrupt):
            raise
        raise UserCodeError(f"importing '{name}' failed: {type(error).__name__}: {error}",
                            f"`python -c 'import {name}'` in the .aspl file's folder shows the "
                            "traceback") from None


def _origin(module: ModuleType) -> str:
    return str(getattr(module, "__file__", None) or module.__name__)


def _where_hint(name: str, base_dir: Path | None) -> str:
    file = name.replace(".", "/") + ".py"
    if base_dir is None:
        return f"install it, or put {file} where Python finds it"
    return f"create {Path(base_dir) / file} beside the .aspl file, or install the module"


def _function_hint(module: ModuleType, function: str) -> str:
    public = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
    return did_you_mean(function, public) or f"define {function} in {_origin(module)}"
