"""dsv41: a workbench for the DeepSeek-V4.1-Flash checkpoint."""

__version__ = "0.1.0"

# Imported on first use, so `import dsv41` (and the header-only commands) never import torch.
_LAZY = {
    "load": ("dsv41.runtime.loader", "load"),
    "LoadReport": ("dsv41.runtime.report", "LoadReport"),
    "LoadError": ("dsv41.checkpoint.checkpoint", "LoadError"),
    "Model": ("dsv41.model.model", "Model"),
    "Numerics": ("dsv41.core.numerics", "Numerics"),
    "Dsv41Error": ("dsv41.core.errors", "Dsv41Error"),
}


def __getattr__(name: str):
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'dsv41' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(target[0]), target[1])
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
