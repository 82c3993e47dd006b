"""Every error type dsv41 raises on purpose is a Dsv41Error, and keeps the built-in base it had."""

import importlib
import inspect
import pkgutil

import dsv41
from dsv41.core.errors import Dsv41Error

# the built-in base each public error type had before the common base, which callers may catch
BUILTIN_BASE = {
    "ConfigError": ValueError,
    "LoadError": ValueError,
    "HeaderError": ValueError,
    "ChatFormatError": ValueError,
    "ImageError": ValueError,
    "TraceFileError": ValueError,
    "EngramError": ValueError,
    "CacheError": RuntimeError,
    "ExpertParallelError": RuntimeError,
    "NonFiniteLogits": RuntimeError,
}
# control flow inside one module, caught there and never raised to a caller
INTERNAL = {
    "Missing",  # audit/evidence.py: a check's field is absent; the runner reports it as not evaluated
    "LongInteger",
}  # text.bounded_ints' JSON hook: each reader catches it and words its own sentence


def _public_error_types():
    found = {}
    for info in pkgutil.walk_packages(dsv41.__path__, "dsv41."):
        if info.name.endswith("__main__"):  # importing it runs the command line
            continue
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if (
                inspect.isclass(value)
                and issubclass(value, Exception)
                and not name.startswith("_")
                and name not in INTERNAL
                and value.__module__ == info.name
                and value.__module__.startswith("dsv41.")
            ):
                found[name] = value
    return found


def test_every_public_error_has_the_common_base():
    types = _public_error_types()
    assert set(BUILTIN_BASE) <= set(types)
    outside = sorted(name for name, kind in types.items() if not issubclass(kind, Dsv41Error))
    assert outside == [], f"error types outside Dsv41Error: {outside}"
    for name, base in BUILTIN_BASE.items():
        assert issubclass(types[name], base), name
    assert dsv41.Dsv41Error is Dsv41Error
