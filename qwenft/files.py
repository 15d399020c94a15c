"""Atomic writes: every file and folder qwenft produces appears whole or not at all.

A file is written to a temporary name in its destination folder and renamed over the target
(``os.replace``, atomic on POSIX within one filesystem); a folder is built in a temporary sibling and
renamed the same way. ``tempfile`` creates both private (0600 / 0700); what is published gets the
permissions an ordinary ``open()`` / ``mkdir()`` would give under the process umask (0644 / 0755 under the
usual 022), so a run directory can be shared or served like any other.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Optional, Union

from qwenft.config import QwenftError

PathLike = Union[str, Path]


def umask() -> int:
    """The process umask (read by setting and restoring it: POSIX offers no read-only call)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def publish_mode(path: PathLike) -> None:
    """Give ``path`` the mode ``open()`` (file: 0666) or ``mkdir()`` (folder: 0777) would, less the umask."""
    base = 0o777 if Path(path).is_dir() else 0o666
    os.chmod(path, base & ~umask())


def publish_tree(root: PathLike) -> None:
    """:func:`publish_mode` for ``root`` and everything under it (some writers, e.g. safetensors, create their
    files 0600)."""
    root = Path(root)
    publish_mode(root)
    for path in root.rglob("*"):
        if not path.is_symlink():
            publish_mode(path)


def file_in_the_way(path: PathLike) -> Optional[Path]:
    """``path`` itself or the nearest of its parents that exists as a file (so ``path`` cannot be a folder or lie
    under one); None when there is none."""
    path = Path(path).expanduser()
    return next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)


def atomic_write_bytes(path: PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` (parents created) through a temporary file and a rename; returns the path.

    On any error the temporary file is removed and an existing ``path`` is left as it was.

    Raises:
        QwenftError: ``path`` is a directory, or one of its parents is a file.
    """
    path = Path(path).expanduser()
    if path.is_dir():
        raise QwenftError(f"{path}: is a directory; name a file")
    blocking = file_in_the_way(path.parent)
    if blocking is not None:
        raise QwenftError(f"{path}: {blocking} is a file, not a directory")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        publish_mode(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: PathLike, text: str) -> Path:
    """:func:`atomic_write_bytes` of ``text`` encoded as UTF-8."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def temp_path(path: PathLike, suffix: str = "") -> Path:
    """A new empty file next to ``path`` for a writer that needs a file name (e.g. matplotlib's ``savefig``);
    rename it over ``path`` with ``os.replace`` when complete, after :func:`publish_mode`."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=suffix or ".tmp", dir=path.parent)
    os.close(fd)
    return Path(tmp)


def staging_dir(parent: PathLike, prefix: str = ".tmp-") -> Path:
    """A new empty folder in ``parent`` to build a result in before renaming it into place, with ordinary
    (umask) permissions rather than ``mkdtemp``'s 0700."""
    work = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    publish_mode(work)
    return work


def publish_dir(built: PathLike, final: PathLike, replace: bool = True) -> Path:
    """Rename the finished folder ``built`` (made with :func:`staging_dir` beside ``final``) to ``final``, its
    files given ordinary permissions first (:func:`publish_tree`).

    An existing ``final`` is replaced when ``replace`` (moved aside, then removed: ``final`` is never missing or
    half-written); otherwise it is kept and ``built`` dropped (another process finished the same thing first).

    Returns:
        ``final`` as a Path.
    """
    import shutil

    built, final = Path(built), Path(final)
    publish_tree(built)
    if final.exists():
        if not replace:
            shutil.rmtree(built, ignore_errors=True)
            return final
        old = final.parent / f".old-{final.name}-{os.getpid()}"
        os.replace(final, old)
        os.replace(built, final)
        shutil.rmtree(old, ignore_errors=True)
        return final
    try:
        os.replace(built, final)
    except OSError:
        if replace or not final.exists():
            raise
        shutil.rmtree(built, ignore_errors=True)  # finished by another process in the meantime
    return final
