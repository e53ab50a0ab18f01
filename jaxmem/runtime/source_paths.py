"""Where jaxmem's own source files are, as XLA's stack frames name them: "jaxmem/core/program.py" whichever
checkout the frame comes from, so a buffer can be traced to the module that made it."""
from __future__ import annotations

import importlib.util
import os
from types import ModuleType

PACKAGE = "jaxmem"
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../jaxmem
_ROOT = os.path.dirname(_PACKAGE_DIR)  # what module paths are relative to


def module_path(module: ModuleType | str) -> str:
    """The path rel_path gives a module's frames: "jaxmem/core/program.py" for jaxmem.core.program, "jaxmem/kernels/"
    for a package (every file under it). A module named by string is located without importing it (for
    modules that import this one); a missing one raises ModuleNotFoundError."""
    if isinstance(module, str):
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.origin:
            raise ModuleNotFoundError(f"attribution: no module {module}")
        file = spec.origin
    else:
        file = module.__file__
    rel = os.path.relpath(file, _ROOT).replace(os.sep, "/")
    if rel.startswith("../"):
        raise ValueError(f"attribution: {file} is not under {_ROOT}")
    return rel.removesuffix("__init__.py") if os.path.basename(file) == "__init__.py" else rel


def rel_path(path: str) -> str:
    """A source file as "jaxmem/...": relative to where jaxmem is imported from, else (a dump made by another
    checkout) from its last "jaxmem/" component."""
    if path.startswith(_PACKAGE_DIR + os.sep):
        return os.path.relpath(path, _ROOT).replace(os.sep, "/")
    i = path.rfind(PACKAGE + "/")
    return path[i:] if i >= 0 else path


def is_ours(path: str) -> bool:
    """A frame in jaxmem's own code (not a dependency's)."""
    if path.startswith(_PACKAGE_DIR + os.sep):
        return True
    return f"{PACKAGE}/" in path and "site-packages" not in path


def in_files(path: str, prefixes) -> bool:
    return rel_path(path).startswith(tuple(prefixes))
