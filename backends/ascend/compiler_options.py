"""Applying the launch plan's torchair options to a torchair CompilerConfig (any object with
torchair's attribute layout: the executors pass the real one, the tests one loaded from the
torch-npu wheel). torch.compile's own arguments (`dynamic`, static shapes) are not set here."""
from __future__ import annotations

COMPILE_ARGUMENTS = ("dynamic", "static_shapes")


def apply_compiler_options(config, compiler: dict):
    for name, value in compiler.items():
        if name in COMPILE_ARGUMENTS:
            continue
        if isinstance(value, dict):
            section = getattr(config, name)
            for option, option_value in value.items():
                setattr(section, option, option_value)
        else:
            setattr(config, name, value)
    return config
