"""The `aspc` command line. The one place that wires the front end, IR and emitters together."""
from __future__ import annotations

import sys
from pathlib import Path

import click

from aspc import __version__
from aspc.compiler import Compilation, compile_file
from aspc.diagnostics import AsplError, render_all
from aspc.dot import to_dot
from aspc.formatter import format_program
from aspc.printer import print_ir
from aspc.serialize import to_json

EMITTERS = {
    "ast": lambda c: format_program(c.program),
    "ir": lambda c: print_ir(c.graph),
    "json": lambda c: to_json(c.graph),
    "dot": lambda c: to_dot(c.graph),
}

_SET_HELP = "Override an option: NAME.option=value (NAME: a stage, model, data, pool, " \
            "`schedule`, or a stage kind for all its stages). Repeatable."


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="aspc")
def main() -> None:
    """aspc: compile RL post-training pipelines (.aspl) into adaptive scheduling pipelines."""


@main.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=_SET_HELP)
def check(files: tuple[str, ...], overrides: tuple[str, ...]) -> None:
    """Parse and check FILES; print diagnostics and exit 1 on any error."""
    failed = 0
    for file in files:
        compilation = _compile(file, overrides, exit_on_error=False)
        if compilation is None:
            failed += 1
        else:
            click.echo(f"{file}: ok ({len(compilation.graph.stages())} stages)")
    if failed:
        sys.exit(1)


@main.command("compile")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--emit", type=click.Choice(sorted(EMITTERS)), default="ir", show_default=True,
              help="What to print: the formatted source, the IR, its JSON or a Graphviz graph.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write to a file instead of stdout.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=_SET_HELP)
def compile_command(file: str, emit: str, output: str | None, overrides: tuple[str, ...]) -> None:
    """Compile FILE and print the artifact chosen with --emit."""
    compilation = _compile(file, overrides)
    text = EMITTERS[emit](compilation)
    if output is None:
        click.echo(text, nl=False)
        return
    try:
        Path(output).write_text(text, encoding="utf-8")
    except OSError as error:
        raise click.ClickException(f"cannot write {output}: {error.strerror}") from None


def _compile(file: str, overrides: tuple[str, ...], exit_on_error: bool = True) -> Compilation | None:
    try:
        compilation = compile_file(file, list(overrides))
    except AsplError as error:
        sources = _sources(file, overrides)
        click.echo(render_all(error.diagnostics, sources), err=True)
        if exit_on_error:
            sys.exit(1)
        return None
    if compilation.warnings:
        click.echo(render_all(compilation.warnings, compilation.sources), err=True)
    return compilation


def _sources(file: str, overrides: tuple[str, ...]) -> dict[str, str]:
    from aspc.overrides import SOURCE, overrides_source

    sources = {SOURCE: overrides_source(overrides)}
    try:
        sources[file] = Path(file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        pass
    return sources
