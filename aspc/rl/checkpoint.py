"""Checkpoints: model weights as safetensors, optimizer state with torch.save, a JSON manifest
that records a SHA-256 of every file and the run's configuration.

A checkpoint is written to a temporary folder, its files and the folder synced to disk, read back
and checked (each safetensors header lists the tensors saved, every file matches its checksum), and
only then renamed into place; then the `latest` file is replaced atomically, so a run killed at any
moment, or a machine that loses power, leaves the previous checkpoint intact. A write that fails (a
full or read-only disk) is a CheckpointError naming the path, never a half-written step folder. Resuming
does not trust `latest`: it walks the step folders from the newest down and takes the first whose
files match their checksums, saying which ones it skipped and why.

A file identical to one of an earlier checkpoint in the folder (the frozen reference, `model ref =
frozen(actor)`, the same at every step) is a hard link to it, not a copy: the folder holds its bytes
once, each step folder stays complete on its own (deleting any of them leaves the others intact), and
resuming reads exactly the bytes that were saved. Where the file system has no hard links it is a copy.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

_STEP = re.compile(r"^step-(\d+)$")


class CheckpointError(Exception):
    """A checkpoint cannot be used (message: which one, why, what to do)."""


@dataclass
class ResumePoint:
    path: Path
    version: int
    skipped: list[str] = field(default_factory=list)  # "step-000010: why it was not used"


def save(directory: Path, version: int, models: dict, optimizers: dict, extra: dict) -> Path:
    """Write the checkpoint of `version` to DIRECTORY/step-NNNNNN (see the module's docstring);
    raises CheckpointError naming the path when it cannot be written or does not read back."""
    final = directory / f"step-{version:06d}"
    tmp = directory / f".tmp-step-{version:06d}"
    try:
        _write_step(directory, tmp, final, version, models, optimizers, extra)
    except CheckpointError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except OSError as error:
        shutil.rmtree(tmp, ignore_errors=True)
        reason = error.strerror or str(error)
        raise CheckpointError(f"cannot write the checkpoint of step {version} to {final}: {reason}"
                              f"{_where(error)}; check the disk's free space and permissions") from None
    return final


def _where(error: OSError) -> str:
    return f" (at {error.filename})" if error.filename else ""


def _write_step(directory: Path, tmp: Path, final: Path, version: int, models: dict, optimizers: dict,
                extra: dict) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    tensors = _write_parts(tmp, models, optimizers)
    files = {p.name: _sha256(p) for p in sorted(tmp.iterdir())}
    earlier = _earlier_files(directory, final.name)
    for name, digest in files.items():
        _link_identical(tmp / name, digest, earlier.get((name, digest)))
    manifest = {"version": version, **extra, "files": files}
    _write_synced(tmp / "manifest.json", json.dumps(manifest, indent=2))
    _check_written(tmp, final, tensors)
    _sync(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _write_synced(directory / ".latest.tmp", final.name)
    os.replace(directory / ".latest.tmp", directory / "latest")
    _sync(directory)


def _write_parts(tmp: Path, models: dict, optimizers: dict) -> dict[str, set[str]]:
    """The models' weights and the optimizers' states, each file synced; returns each safetensors
    file's tensor names (what its header must list)."""
    tensors = {}
    for name, model in models.items():
        if model is not None:
            state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
            _written(save_file, state, tmp / f"{name}.safetensors")
            tensors[f"{name}.safetensors"] = set(state)
    for name, optimizer in optimizers.items():
        if optimizer is not None:
            _written(torch.save, optimizer.state_dict(), tmp / f"{name}.optimizer.pt")
    for file in tmp.iterdir():
        _sync(file)
    return tensors


def _written(write, value, path: Path) -> None:
    """`write(value, path)`; the writers' own errors on a failed write (safetensors' SafetensorError,
    torch's RuntimeError from its zip writer, e.g. on `ulimit -f`) become an OSError naming `path`."""
    try:
        write(value, str(path))
    except OSError:
        raise
    except Exception as error:  # SafetensorError is a bare Exception subclass
        raise OSError(None, f"the write failed ({str(error).splitlines()[0]})", str(path)) from None


def _check_written(tmp: Path, final: Path, tensors: dict[str, set[str]]) -> None:
    """Read what was written back before it replaces anything: every file matches the checksum in
    the manifest, every safetensors header lists the tensors saved."""
    problem = verify(tmp)
    for name, expected in tensors.items():
        if problem is None and _tensor_names(tmp / name) != expected:
            problem = f"{name} does not list the tensors saved"
    if problem is not None:
        raise CheckpointError(f"the checkpoint written to {final} does not read back: {problem}")


def _tensor_names(file: Path) -> set[str] | None:
    try:
        with safe_open(str(file), framework="pt") as opened:
            return set(opened.keys())
    except Exception:  # a damaged header: safetensors raises its own error types
        return None


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())


def _sync(path: Path) -> None:
    """fsync a file or a folder (a folder: the names in it, e.g. a rename, reach the disk)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _earlier_files(directory: Path, writing: str) -> dict[tuple[str, str], Path]:
    """(file name, SHA-256) -> that file in an earlier step folder, from their manifests."""
    found = {}
    for _, path in sorted(step_folders(directory)):
        if path.name == writing:
            continue
        try:
            files = read_manifest(path).get("files")
        except CheckpointError:
            continue
        if isinstance(files, dict):
            found.update({(name, digest): path / name for name, digest in files.items()})
    return found


def _link_identical(file: Path, digest: str, earlier: Path | None) -> None:
    """Replace `file` by a hard link to `earlier` (the same name and checksum in an earlier step
    folder) when that one still holds those bytes; otherwise, or without hard links, keep the copy."""
    if earlier is None or not earlier.is_file() or earlier.stat().st_size != file.stat().st_size:
        return
    if _sha256(earlier) != digest:  # damaged since it was written: a fresh copy is better
        return
    linked = file.with_name(file.name + ".link")
    try:
        os.link(earlier, linked)
    except OSError:  # no hard links here (or another file system): the copy stays
        return
    os.replace(linked, file)


def find_resume_point(directory: Path) -> ResumePoint | None:
    """The newest intact checkpoint in `directory` (None: there is none), with the reasons the
    newer ones were skipped."""
    skipped: list[str] = []
    for version, path in sorted(step_folders(directory), reverse=True):
        problem = verify(path)
        if problem is None:
            return ResumePoint(path, version, skipped + _pointer_note(directory, path))
        skipped.append(f"{path.name}: {problem}")
    if skipped:
        raise CheckpointError(f"{directory}: no intact checkpoint (" + "; ".join(skipped) + "); start a new "
                              "run without --resume, or point --checkpoint at another folder")
    return None


def verify(path: Path) -> str | None:
    """Why the checkpoint in `path` cannot be used, or None when every file matches its checksum."""
    try:
        manifest = read_manifest(path)
    except CheckpointError as error:
        return str(error)
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return "its manifest lists no checksums (written by an older aspc)"
    for name, digest in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if _sha256(file) != digest:
            return f"{name} is damaged (checksum mismatch, {file.stat().st_size} bytes)"
    return None


def read_manifest(path: Path) -> dict:
    try:
        manifest = json.loads((path / "manifest.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError("manifest.json is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"manifest.json is unreadable ({type(error).__name__})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("version"), int):
        raise CheckpointError("manifest.json has no version")
    return manifest


def load(path: Path, models: dict, optimizers: dict) -> dict:
    try:
        for name, model in models.items():
            if model is not None:
                model.load_state_dict(load_file(str(path / f"{name}.safetensors")))
        for name, optimizer in optimizers.items():
            if optimizer is not None:
                optimizer.load_state_dict(torch.load(path / f"{name}.optimizer.pt", weights_only=False))
    except Exception as error:  # damaged in a way the checksums did not catch, or another model's
        raise CheckpointError(f"{path}: cannot load the checkpoint: {type(error).__name__}: "
                              f"{str(error).splitlines()[0] if str(error) else ''}") from None
    return read_manifest(path)


def step_folders(directory: Path) -> list[tuple[int, Path]]:
    if not directory.is_dir():
        return []
    return [(int(m.group(1)), p) for p in directory.iterdir() if p.is_dir() and (m := _STEP.match(p.name))]


def _pointer_note(directory: Path, chosen: Path) -> list[str]:
    pointer = directory / "latest"
    if not pointer.exists():
        return []
    named = pointer.read_text(errors="replace").strip()
    return [] if named == chosen.name else [f"latest: it names {named!r}, which is not the newest intact checkpoint"]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
