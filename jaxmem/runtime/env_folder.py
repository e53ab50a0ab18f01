"""A folder named by an environment variable for the length of a block, unless the user named one already."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path


@contextlib.contextmanager
def defaulted(env: str, folder: Path):
    """Within the block `env` names `folder` (absolute) unless it already names a folder, which then stays; yields
    the folder in use. Sweep and tune turn their caches on so for the worker processes they start."""
    if os.environ.get(env):
        yield Path(os.environ[env])
        return
    os.environ[env] = str(Path(folder).absolute())
    try:
        yield Path(folder)
    finally:
        os.environ.pop(env, None)
