"""Whether a file a folder names (a listing's entry, a file found in it) stays inside that folder: what a data or
model folder lists is read, so an entry such as "../secret.arrow", an absolute path, or a symlink leading out
would read files the user never pointed at."""
from __future__ import annotations

from pathlib import Path


def plain_name(name: str) -> bool:
    """A name relative to its folder, without '..', not empty, without NUL: checked on the name alone."""
    parts = Path(name).parts
    return bool(parts) and not Path(name).is_absolute() and ".." not in parts and "\0" not in name


def stays_inside(folder: Path, path: Path) -> bool:
    """`path`, symlinks followed, lies inside `folder` (symlinks followed too). A Hugging Face hub cache keeps
    a snapshot's files as links into its repository's blobs/ folder (`<repo>/snapshots/<rev>/...` ->
    `<repo>/blobs/<hash>`), so a link from a snapshot into that blobs/ folder stays inside too."""
    real_folder, real = folder.resolve(), path.resolve()
    if real.is_relative_to(real_folder):
        return True
    for above in (folder.absolute(), *folder.absolute().parents):
        if above.name == "snapshots":
            blobs = above.parent / "blobs"
            return blobs.is_dir() and real.is_relative_to(blobs.resolve())
    return False
