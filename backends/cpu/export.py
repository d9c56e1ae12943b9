"""`aspc export`: a run's checkpoint (a step folder, or the --checkpoint folder of `aspc run`,
whose newest intact step is taken) -> a Hugging Face checkpoint directory of its trained actor,
for an actor loaded from hf("DIR"): the manifest names DIR and the dtype (executors.py)."""
from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file

from aspc.rl import checkpoint
from aspc.rl.checkpoint import CheckpointError
from aspc.backends.cpu.hf_weights import export_hf


def export_checkpoint(path: Path, out: Path) -> tuple[Path, int]:
    """Write the actor of the checkpoint at `path` to `out` (a new or empty folder); returns the
    step folder used and its version. Raises CheckpointError with what to do."""
    step = _step_folder(path)
    manifest = checkpoint.read_manifest(step)
    source = manifest.get("hf", {}).get("actor")
    if source is None:
        raise CheckpointError(f"{step}: the run's actor was not loaded from hf(\"DIR\"), so there is no "
                              "Hugging Face checkpoint to write it back as (tiny models use a character "
                              "tokenizer that transformers and vLLM do not read)")
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{out} is not empty: export into a new or empty folder")
    problem = checkpoint.verify(step)
    if problem is not None:
        raise CheckpointError(f"{step}: {problem}")
    if not Path(source["source"]).is_dir():
        raise CheckpointError(f"{source['source']}: the checkpoint directory the run started from is gone; "
                              "export copies its config.json and tokenizer files")
    state = load_file(str(step / "actor.safetensors"))
    export_hf(state, Path(source["source"]), out, source["dtype"])
    return step, manifest["version"]


def _step_folder(path: Path) -> Path:
    if (path / "manifest.json").exists():
        return path
    point = checkpoint.find_resume_point(path)
    if point is None:
        raise CheckpointError(f"{path}: no checkpoint here: give the --checkpoint folder of `aspc run`, or one "
                              "of its step-NNNNNN folders")
    return point.path
