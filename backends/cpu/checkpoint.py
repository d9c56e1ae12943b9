"""Checkpoints: model weights as safetensors, optimizer state with torch.save, a JSON manifest.

A checkpoint is written to a temporary folder and renamed into place, then the `latest` file is
replaced atomically, so a run killed at any moment leaves the previous checkpoint intact.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def save(directory: Path, version: int, models: dict, optimizers: dict, extra: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"step-{version:06d}"
    tmp = directory / f".tmp-step-{version:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for name, model in models.items():
        if model is not None:
            state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
            save_file(state, str(tmp / f"{name}.safetensors"))
    for name, optimizer in optimizers.items():
        if optimizer is not None:
            torch.save(optimizer.state_dict(), tmp / f"{name}.optimizer.pt")
    (tmp / "manifest.json").write_text(json.dumps({"version": version, **extra}, indent=2))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    pointer = directory / ".latest.tmp"
    pointer.write_text(final.name)
    os.replace(pointer, directory / "latest")
    return final


def latest(directory: Path) -> Path | None:
    pointer = directory / "latest"
    if not pointer.exists():
        return None
    path = directory / pointer.read_text().strip()
    return path if (path / "manifest.json").exists() else None


def load(path: Path, models: dict, optimizers: dict) -> dict:
    for name, model in models.items():
        if model is not None:
            model.load_state_dict(load_file(str(path / f"{name}.safetensors")))
    for name, optimizer in optimizers.items():
        if optimizer is not None:
            optimizer.load_state_dict(torch.load(path / f"{name}.optimizer.pt", weights_only=False))
    return json.loads((path / "manifest.json").read_text())
