"""Where a command's text goes: standard output, or the file of `-o`."""
from __future__ import annotations

from pathlib import Path

import click


def write_output(text: str, output: str | None) -> None:
    """`text` to standard output when `output` is None, else to that file (an error names it)."""
    if output is None:
        click.echo(text, nl=False)
        return
    try:
        Path(output).write_text(text, encoding="utf-8")
    except OSError as error:
        raise click.ClickException(f"cannot write {output}: {error.strerror}") from None
