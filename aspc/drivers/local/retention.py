"""Checkpoint retention (`aspc run --keep N`): the newest N step checkpoints stay, older ones go.

The decision is a pure function of the step numbers; the runtime deletes what it names right after
a checkpoint is written, so the one just written (intact: its files were checksummed as written) is
always among those kept. Folders of steps after it (left by a run that resumed from an older
checkpoint, past damaged newer ones) are neither counted nor deleted: the run writes over them.
"""
from __future__ import annotations

import shutil
from os import PathLike


def steps_to_prune(steps: list[int], written: int, keep: int | None) -> list[int]:
    """The steps whose checkpoints go once `written` is saved: all but the newest `keep` of those up
    to `written` (None: keep every one)."""
    if keep is None:
        return []
    if keep < 1:
        raise ValueError(f"--keep must keep at least 1 checkpoint, not {keep}")
    older = sorted((s for s in steps if s < written), reverse=True)
    return sorted(older[keep - 1:])


def prune(folders: list[tuple[int, str | PathLike[str]]], written: int, keep: int | None) -> list[int]:
    """Delete the step folders (step, path) that `steps_to_prune` names; returns their steps."""
    paths = dict(folders)
    gone = steps_to_prune(list(paths), written, keep)
    for step in gone:
        shutil.rmtree(paths[step], ignore_errors=True)
    return gone
