"""One process per run directory: default run directories unique per process, and a lock held for the whole command.

- :func:`run_stamp` names the default run directory (``outputs/<run_name>/<stamp>``, for ``eval``
  ``outputs/eval/<run_name>/<stamp>`` (:func:`run_group`), ``${qwenft_run_id:}`` in conf/config.yaml): the start
  time plus this process's id, or the W&B run id under a sweep agent, so two launches in the same second never
  share a directory. It is fixed once per command (the CLI composes the config twice; both get the same name);
  under torchrun rank 0's is broadcast (:func:`qwenft.train.dist.launch_overrides`).
- :class:`RunLock` is an OS file lock (the ``filelock`` package, ``flock``) on ``<dir>/.qwenft.lock`` for
  ``train`` and ``eval`` (``merge``: ``.<DIR>.qwenft.lock`` beside its ``out=DIR``, which appears only when
  verified), taken by the CLI before anything is written and held until the command ends. The holder's process
  id is in ``.qwenft.lock.pid`` beside the lock while it holds it. The kernel drops the lock when its holder
  dies, however it dies, so a lock left by a killed run never blocks the next one. The empty lock file stays (two
  processes could otherwise lock two files of one name), except in a folder the lock made that stayed unused.
- Whether a process that left a file behind still lives is asked of the same OS lock, never of ``/proc``: the
  writer holds the file's lock while it runs (:func:`write_locked`), and a lock that can be taken has no live
  holder (:func:`holder_text`, :func:`abandoned`). So a pid file a killed run left is told from the live holder's,
  and ``merge`` tells its dead staging folders from live ones (:mod:`qwenft.export`).
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from qwenft.config import Config, QwenftError
from qwenft.files import file_in_the_way, publish_mode

LOCK_NAME = ".qwenft.lock"
PID_NAME = ".qwenft.lock.pid"
LOCK_FILES = (LOCK_NAME, PID_NAME)  # what the lock puts in a run directory
HOLDER_WAIT_S = 2.0  # how long a refused process waits for the holder to record its process id

_stamp: Optional[str] = None


class RunLocked(QwenftError):
    """Another live process holds the lock of the run directory (the message names the directory and its pid)."""


def run_tag() -> str:
    """This process's suffix of a default run directory: ``WANDB_RUN_ID`` under a W&B sweep agent (which sets it
    together with ``WANDB_SWEEP_ID``), else the process id."""
    if os.environ.get("WANDB_SWEEP_ID"):
        tag = re.sub(r"[^A-Za-z0-9_-]", "", os.environ.get("WANDB_RUN_ID", ""))[:32]
        if tag:
            return tag
    return str(os.getpid())


def run_stamp() -> str:
    """``YYYY-mm-dd_HH-MM-SS_<tag>`` (local time, :func:`run_tag`), the same for every call until
    :func:`new_run_stamp`; the ``${qwenft_run_id:}`` resolver."""
    global _stamp
    if _stamp is None:
        _stamp = f"{time.strftime('%Y-%m-%d_%H-%M-%S')}_{run_tag()}"
    return _stamp


def run_group(command: str) -> str:
    """The folder under ``outputs/`` that holds a command's default run directories before ``<run_name>/``:
    ``eval/`` for ``eval`` (so an evaluation of a recipe never lands beside that recipe's training runs), else
    nothing; the ``${qwenft_run_group:${command}}`` resolver of conf/config.yaml."""
    return "eval/" if command == "eval" else ""


def new_run_stamp() -> str:
    """Start a new stamp (the CLI calls this once per command, so two commands in one process get two)."""
    global _stamp
    _stamp = None
    return run_stamp()


def write_locked(path, text: str) -> int:
    """Write ``text`` to ``path`` (a temporary file renamed over it) and hold the file's OS lock (``flock``, through
    filelock's ``lock_descriptor``) until the returned descriptor is closed.

    While the writer lives, :func:`holder_text` reads ``text`` and :func:`abandoned` is False; once it is gone,
    however it went (SIGKILL included; a zombie holds no locks), the kernel has dropped the lock.

    Returns:
        The descriptor holding the lock: close it (after removing ``path``, if it is to go) to let go.
    """
    from filelock import lock_descriptor  # here: 45 ms to import, which --help and plan need not pay

    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.write(fd, text.encode("utf-8"))
        try:
            lock_descriptor(fd, blocking=False)  # a new file: nobody else can hold it
        except OSError:  # no flock on this filesystem: readers then count the writer as alive (_probe)
            pass
        publish_mode(tmp)
        os.replace(tmp, path)  # locked before it appears: a reader never sees it unlocked while the writer lives
    except BaseException:
        os.close(fd)
        Path(tmp).unlink(missing_ok=True)
        raise
    return fd


def _probe(path) -> Optional[Tuple[str, bool]]:
    """``(text, held)`` of a file written by :func:`write_locked`: ``held`` is whether a live process holds its lock
    (a lock this process can take has no holder; it is let go at once). None when there is no such file."""
    from filelock import lock_descriptor, unlock_descriptor

    try:
        try:
            fd = os.open(path, os.O_RDWR)  # (some network filesystems lock only files open for writing)
        except PermissionError:
            fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb", closefd=False) as handle:  # the same open file as the lock: no rename in between
            text = handle.read().decode("utf-8", errors="replace")
        try:
            free = lock_descriptor(fd, blocking=False)
        except OSError:  # no flock here: whether the writer lives cannot be told, so it counts as alive
            return text, True
        if free:
            unlock_descriptor(fd)
        return text, not free
    finally:
        os.close(fd)


def lock_held(path) -> bool:
    """Whether a live process holds the OS lock of the lock file ``path`` (``flock`` refuses it; a filesystem without
    ``flock`` counts as held: who holds it cannot be told there, as in :func:`holder_text`).

    Raises:
        OSError: the OS refuses to open the file (or, when it is missing, to create it): the reason the lock cannot
            be taken.
    """
    from filelock import lock_descriptor, unlock_descriptor

    try:
        fd = os.open(path, os.O_RDWR)
    except PermissionError:
        fd = os.open(path, os.O_RDONLY)  # flock needs no write access; the holder may be another user
    except FileNotFoundError:  # the lock could not create it: creating it says why (or it is free after all)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            free = lock_descriptor(fd, blocking=False)
        except OSError:
            return True
        if free:
            unlock_descriptor(fd)
        return not free
    finally:
        os.close(fd)


def os_reason(exc: OSError) -> str:
    """The OS's reason in ``exc``; for a file a folder that exists refused to create (ENOENT: a pseudo filesystem
    such as /proc), that said too."""
    reason = exc.strerror or str(exc)
    name = Path(exc.filename) if isinstance(exc.filename, str) else None
    if isinstance(exc, FileNotFoundError) and name is not None and name.parent.is_dir():
        reason += f" (the folder {name.parent} exists but takes no new files there)"
    return reason


def holder_text(path) -> Optional[str]:
    """The text of ``path`` (:func:`write_locked`) while its writer lives; None when the file is missing or was
    left by a process that is gone."""
    probe = _probe(path)
    return probe[0] if probe is not None and probe[1] else None


def abandoned(path) -> bool:
    """Whether ``path`` (:func:`write_locked`) exists and its writer is gone (False while it lives, or when there
    is no such file)."""
    probe = _probe(path)
    return probe is not None and not probe[1]


class RunLock:
    """The lock of one run directory, for one process (not re-entrant: a second acquire in the same process is
    refused like any other process).

    Args:
        directory: The run directory (``out_dir``, or merge's ``out``) named in messages.
        key: The setting that chose it, for the message (``out_dir`` or ``out``).
        beside: Put the lock beside ``directory`` (``.<name>.qwenft.lock`` in its parent) instead of inside it.
    """

    def __init__(self, directory, key: str = "out_dir", beside: bool = False):
        self.directory = Path(directory).expanduser().resolve()
        self.key = key
        folder = self.directory.parent if beside else self.directory
        prefix = f".{self.directory.name}" if beside else ""
        self.path = folder / f"{prefix}{LOCK_NAME}"
        self.pid_path = folder / f"{prefix}{PID_NAME}"
        self._lock = None
        self._pid_fd: Optional[int] = None  # holds the pid file's own lock (write_locked)
        self._created: List[Path] = []  # folders the lock made, deepest first (removed again when left unused)

    def holder(self) -> Optional[int]:
        """The process id recorded by the holder, when that process is alive; None when unknown (no pid file yet,
        or the one a killed holder left: nobody holds its lock)."""
        text = holder_text(self.pid_path)
        try:
            return int(text.strip()) if text is not None else None
        except ValueError:
            return None

    def acquire(self) -> "RunLock":
        """Take the lock without waiting for it (the folder is created when missing) and record this process's id.

        Raises:
            RunLocked: a live process holds it: one line naming the directory and that process's id.
            QwenftError: the OS refuses the lock file (no permission, a read-only or pseudo filesystem such as
                /proc): one line naming it and the OS's reason, never "in use".
        """
        from filelock import FileLock, Timeout  # here: 45 ms to import, which --help and plan need not pay

        folder = self.path.parent
        self._created = [p for p in (folder, *folder.parents) if not p.exists()]
        try:
            folder.mkdir(parents=True, exist_ok=True)
            lock = FileLock(str(self.path), timeout=0)
            deadline = time.monotonic() + HOLDER_WAIT_S
            while True:
                try:
                    lock.acquire(timeout=0)
                    break
                except Timeout:
                    # filelock times out also when the OS refuses the file (a folder that takes no new files, as
                    # /proc): "in use" only when a live process is seen holding it, else the OS's reason
                    pid = self.holder()  # None: the holder has not written it yet, or has just let go: try again
                    held = pid is not None or lock_held(self.path)
                    if pid is not None or (held and time.monotonic() > deadline):
                        who = f"process {pid}" if pid is not None else "another process"
                        raise RunLocked(f"{self.key}={self.directory} is in use by {who} (it holds {self.path}); "
                                        f"wait for it to end or choose another {self.key}") from None
                    if time.monotonic() > deadline:  # free each time it was looked at, yet never taken
                        self._remove_created()
                        raise QwenftError(f"{self.key}={self.directory}: cannot lock {self.path}, though no process "
                                          "holds it") from None
                    time.sleep(0.05)
        except OSError as exc:
            self._remove_created()
            raise QwenftError(f"{self.key}={self.directory}: cannot lock {self.path}: {os_reason(exc)}") from None
        self._lock = lock
        try:
            self._pid_fd = write_locked(self.pid_path, f"{os.getpid()}\n")
        except BaseException as exc:
            self.release()
            if isinstance(exc, OSError):
                raise QwenftError(f"{self.key}={self.directory}: cannot write {self.pid_path}: "
                                  f"{os_reason(exc)}") from None
            raise
        return self

    def _remove_created(self) -> None:
        """Remove the folders :meth:`acquire` created, each when nothing but the lock file is in it."""
        for folder in self._created:
            try:
                if folder == self.path.parent and {p.name for p in folder.iterdir()} <= {self.path.name}:
                    self.path.unlink(missing_ok=True)
                folder.rmdir()
            except OSError:  # gone already, or something else is in it: kept
                pass

    def release(self) -> None:
        """Let the lock go; removes the pid file, and the folders :meth:`acquire` created if nothing else was put
        in them (a run refused before it wrote anything leaves no directory). Idempotent."""
        if self._lock is None:
            return
        try:
            self.pid_path.unlink(missing_ok=True)
            self._remove_created()  # before letting go: whoever finds the folder gone afterwards makes its own
        finally:
            if self._pid_fd is not None:
                os.close(self._pid_fd)
                self._pid_fd = None
            self._lock.release()
            self._lock = None


def lock_run_dirs(command: str, configs: Sequence[Config], run_dir_commands: Sequence[str]) -> List[RunLock]:
    """Lock what ``command`` writes: ``out_dir`` for ``run_dir_commands`` (with ``-m``: the grid's folder), the
    folder beside ``out=`` for merge. Under torchrun / accelerate launch only rank 0 locks (its ``out_dir`` is
    the one broadcast to the other ranks, which must not refuse each other).

    Raises:
        RunLocked: another live process holds one (nothing stays locked).
    """
    paths: List[RunLock] = []
    if os.environ.get("RANK", "0") != "0":
        return paths
    if command in run_dir_commands:
        paths = [RunLock(d) for d in dict.fromkeys(str(Path(c.out_dir).expanduser().resolve()) for c in configs)]
    elif command == "merge" and configs[0].out and file_in_the_way(Path(configs[0].out).expanduser().parent) is None:
        paths = [RunLock(configs[0].out, key="out", beside=True)]  # (a file in the way: merge names it)
    taken: List[RunLock] = []
    try:
        for lock in paths:
            taken.append(lock.acquire())
    except BaseException:
        for lock in taken:
            lock.release()
        raise
    return taken
