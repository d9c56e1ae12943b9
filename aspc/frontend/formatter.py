"""AST -> canonical .aspl text (`--emit ast`), comments kept; parsing the output gives the same AST back."""
from __future__ import annotations

from aspc.frontend import ast
from aspc.ir.values import format_value


def format_program(program: ast.Program) -> str:
    """One line per declaration, each comment above its declaration or at the end of its line
    (aspc/frontend/comments.py); comments whose declaration is gone come last."""
    pending = list(program.comments)
    lines = []
    for decl in program.decls:
        key = ast.decl_key(decl)
        mine = [c for c in pending if c.anchor == key]
        pending = [c for c in pending if c.anchor != key]
        lines += [c.text for c in mine if not c.trailing]
        lines.append(_decl(decl) + "".join(f"  {c.text}" for c in mine if c.trailing))
    lines += [c.text for c in pending]
    return "\n".join(lines) + "\n"


def _decl(decl: ast.Decl) -> str:
    if isinstance(decl, ast.Pipeline):
        return f"pipeline {decl.name}"
    if isinstance(decl, ast.Pool):
        return f"pool {decl.name} = {decl.hardware} x {value(decl.count)}"
    if isinstance(decl, (ast.Model, ast.Data)):
        keyword = "model" if isinstance(decl, ast.Model) else "data"
        args = "" if decl.args is None else "(" + ", ".join(value(a) for a in decl.args) + ")"
        return f"{keyword} {decl.name} = {decl.source}{args}{_block(decl.options)}"
    if isinstance(decl, ast.Stage):
        args = ", ".join(value(a) for a in decl.args)
        pool = f" on {decl.pool.name}" if decl.pool else ""
        return f"stage {decl.name} = {decl.kind}({args}){pool}{_block(decl.options)}"
    return f"schedule {decl.kind}{_block(decl.options)}"


def _block(options: tuple[ast.Option, ...]) -> str:
    if not options:
        return ""
    return " { " + ", ".join(f"{o.name} = {value(o.value)}" for o in options) + " }"


def value(v: ast.Value) -> str:
    if isinstance(v, ast.Size):
        return v.text
    if isinstance(v, ast.Name):
        return v.name
    if isinstance(v, ast.List):
        return "[" + ", ".join(value(i) for i in v.items) + "]"
    if isinstance(v, ast.Call):
        args = [value(a) for a in v.args] + [f"{o.name} = {value(o.value)}" for o in v.kwargs]
        return f"{v.func}({', '.join(args)})"
    return format_value(v.value)
