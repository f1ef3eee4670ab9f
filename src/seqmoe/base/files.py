"""Writing output files whole or not at all."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from seqmoe.base.errors import UserError


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike):
    """Yield a temporary path next to `path`; rename it to `path` only if the block succeeds.

    A failure leaves no partial file behind::

        with atomic_path("out.safetensors") as tmp:
            save_file(tensors, tmp)
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield tmp
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file the usual permissions
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def check_output(path: str | os.PathLike, flag: str, *, folder: bool = False) -> None:
    """UserError now, before any work, when `path` cannot be written as a file (`folder`: a folder) later:
    it is a folder (a file), or a file stands where one of its parent folders would be."""
    path = Path(path)
    if folder and path.is_file():
        raise UserError(f"{flag} {path} is a file; give a folder to write into")
    if not folder and path.is_dir():
        raise UserError(f"{flag} {path} is a folder; give a file name, e.g. {path / 'rows.jsonl'}")
    for parent in path.parents:
        if parent.is_file():
            raise UserError(f"{flag} {path}: {parent} is a file, not a folder")
