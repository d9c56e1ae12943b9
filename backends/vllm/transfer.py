"""What every weight-transfer backend shares, whichever carries the bytes (gloo on a CPU, HCCL or NPU
IPC on NPUs): the LLM calls of one refresh, the metadata an engine worker receives a version by, and
the trainer's side of a refresh run on a thread of its own while the engine's update_weights blocks
(VllmEngine.load_weights: `sender.start(version, instance)`, then `sender.wait(pending)`)."""
from __future__ import annotations

import threading
from collections.abc import Callable

# The LLM methods that refresh weights, in the order the driver calls them (vllm/entrypoints/llm.py).
TRANSFER_CALLS = ["init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update"]


def update_info(tensors: dict) -> dict:
    """The names, dtypes and shapes of `tensors` in sending order (sorted names): the fields of vLLM's
    NCCL update info, which gloo_worker.GlooUpdateInfo and vllm-ascend's HCCL one share."""
    names = sorted(tensors)
    return {"names": names, "dtype_names": [str(tensors[n].dtype).removeprefix("torch.") for n in names],
            "shapes": [list(tensors[n].shape) for n in names]}


def send_on_thread(send: Callable[[], None], name: str):
    """Start `send` on a thread of its own; the pending send that `wait_sent` finishes."""
    errors: list = []

    def run():
        try:
            send()
        except Exception as error:  # re-raised on the engine's side by wait_sent()
            errors.append(error)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread, errors


def wait_sent(pending) -> None:
    """Wait for a send `send_on_thread` started; its error, if any, raises here."""
    thread, errors = pending
    thread.join()
    if errors:
        raise errors[0]
