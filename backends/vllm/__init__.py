"""vLLM as the generation engine on every platform (a sibling of the CPU and Ascend backends, which
both drive it): `engine.py` (the one engine class: requests, continuous batching, log-probs, the
weight refresh), `versions.py` (what differs between the vLLM releases it runs on, each row read in
that release's source), `gloo_transfer.py` (the weight-transfer backend for CPU engines, registered
with vLLM as a plugin; its worker side is `gloo_worker.py`). vLLM is imported only when an engine
starts, and only here and in the Ascend backend."""
