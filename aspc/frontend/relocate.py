"""A program written to another folder (`aspc tune FILE -o DIR/x.aspl`): its relative paths still
name the same files.

Paths in a program are relative to its .aspl file: `jsonl("FILE")`, `hf("DIR")` and a model's
`checkpoint = "PATH"`. Written elsewhere, each is rewritten relative to the new folder. A Python
module of `python = "module:function"` (rewards, tools) is looked up beside the .aspl file by its
name, which no path can replace: a module found beside the source but not beside the new file is
an error, with what to do.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from aspc.frontend import ast
from aspc.frontend.diagnostics import Diagnostic


def relocate(program: ast.Program, source_dir: Path, target_dir: Path) -> tuple[ast.Program, int]:
    """The program with each relative path rewritten from `source_dir` to `target_dir`, and how
    many were rewritten."""
    moved = _Mover(Path(source_dir).resolve(), Path(target_dir).resolve())
    decls = tuple(moved.decl(d) for d in program.decls)
    return replace(program, decls=decls), moved.count


def modules_left_behind(program: ast.Program, source_dir: Path, target_dir: Path) -> list[Diagnostic]:
    """An error at each `"module:function"` whose module is beside the source, not beside the target."""
    found = []
    for spec in python_specs(program):
        top = spec.value.partition(":")[0].partition(".")[0]
        if _beside(Path(source_dir), top) and not _beside(Path(target_dir), top):
            found.append(Diagnostic(
                "error", spec.span,
                f"Python module '{top}' is looked up beside the .aspl file, and {target_dir} has no {top}.py",
                f"copy {Path(source_dir) / top}.py to {target_dir}/, or write the file beside the source "
                f"(-o {Path(source_dir) / 'NAME.aspl'})"))
    return found


def python_specs(program: ast.Program) -> Iterator[ast.Str]:
    """Every `"module:function"` string of the program's stages (python = ..., python(...), tool(python = ...))."""
    for decl in program.decls:
        if isinstance(decl, ast.Stage):
            for option in decl.options:
                yield from _specs_in(option.value, option.name)


def _specs_in(value: ast.Value, name: str | None, call: str | None = None) -> Iterator[ast.Str]:
    if isinstance(value, ast.Str):
        if name == "python" or (call == "python" and name in ("function", None)):
            yield value
    elif isinstance(value, ast.List):
        for item in value.items:
            yield from _specs_in(item, None)
    elif isinstance(value, ast.Call):
        if value.func == "python" and value.args:
            yield from _specs_in(value.args[0], None, "python")
        for option in value.kwargs:
            yield from _specs_in(option.value, option.name, value.func)


def _beside(folder: Path, top: str) -> bool:
    return (folder / f"{top}.py").is_file() or (folder / top / "__init__.py").is_file()


class _Mover:
    def __init__(self, source: Path, target: Path):
        self.source, self.target, self.count = source, target, 0

    def decl(self, decl: ast.Decl) -> ast.Decl:
        if isinstance(decl, ast.Data) and decl.source == "jsonl":
            return replace(decl, args=self._first_arg(decl.args))
        if isinstance(decl, ast.Model):
            args = self._first_arg(decl.args) if decl.source == "hf" else decl.args
            options = tuple(replace(o, value=self._path(o.value)) if o.name == "checkpoint" else o
                            for o in decl.options)
            return replace(decl, args=args, options=options)
        return decl

    def _first_arg(self, args):
        if not args:
            return args
        return (self._path(args[0]), *args[1:])

    def _path(self, value: ast.Value) -> ast.Value:
        if not isinstance(value, ast.Str) or not value.value or Path(value.value).is_absolute():
            return value
        moved = Path(os.path.relpath(self.source / value.value, self.target)).as_posix()
        if moved == value.value:
            return value
        self.count += 1
        return replace(value, value=moved)
