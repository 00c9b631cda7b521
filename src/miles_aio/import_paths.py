"""Import paths of user code: `pkg.mod:attr` (or miles' dotted `pkg.mod.attr`), with errors that name them.

A leaf module (no miles_aio imports but errors), so every box that loads user code can use it without
importing the plug-in resolution (`miles_aio.plugins`), which itself checks the boxes' configs.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from miles_aio.errors import PluginError

__all__ = ["IMPORTABLE", "load_object", "require_coroutine_function"]

IMPORTABLE = (
    "A plug-in module must be importable by the process that loads it: `python -m` puts the directory "
    "you start from on the path; for a module anywhere else, add its directory to PYTHONPATH "
    "(PYTHONPATH=/path/to/dir python -m recipes.<name> ...)."
)
"""What an unimportable plug-in module's error adds."""


def load_object(path: str) -> Any:
    """Import `pkg.mod:attr` (or `pkg.mod.attr`) and return the attribute; PluginError names the path."""
    if ":" in path:
        module_name, _, attr_path = path.partition(":")
    else:
        module_name, _, attr_path = path.rpartition(".")
    if not module_name or not attr_path:
        raise PluginError(f"{path!r} is not an import path of the form pkg.mod:attr")
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and (module_name + ".").startswith(e.name + "."):  # the plug-in itself
            raise PluginError(
                f"cannot import module {module_name!r} of {path!r}: no module named {e.name!r} on the "
                f"Python path. {IMPORTABLE}"
            ) from e
        raise PluginError(f"cannot import module {module_name!r} of {path!r}: {e}") from e  # one it imports
    except ImportError as e:
        raise PluginError(f"cannot import module {module_name!r} of {path!r}: {e}") from e
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as e:
            raise PluginError(f"{path!r}: module {module_name!r} has no attribute {attr_path!r}") from e
    return obj


def require_coroutine_function(path: str) -> Any:
    """Load `path` and check that it is an `async def` function (rollout and reward plug-ins are)."""
    fn = load_object(path)
    if not inspect.iscoroutinefunction(fn):
        raise PluginError(f"{path!r} must be an `async def` function, got {type(fn).__name__}")
    return fn
