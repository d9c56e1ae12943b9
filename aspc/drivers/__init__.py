"""Drivers that run the controller: the simulator, the local runtime and the Ray runtime."""
