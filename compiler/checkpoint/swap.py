"""Putting a checkpoint in place so that a crash at any moment loses neither the old nor the new one.

The files are written into a staging folder beside the target, named after the process that
writes it (`.<name>.saving.<pid>.<seconds>.<token>.<host>`), flushed to the disk, marked complete
(stagewise.json, last), then swapped in: the old checkpoint is renamed to `.<name>.old`, the
staging folder to `<name>`, and only then is the old one removed. At every moment the path holds
the old or the new checkpoint, except between the two renames, when `.<name>.old` holds the old
one complete and `load` reads it from there. Staging folders of saves that died (their process is
gone, or they are over an hour old) are removed by the next save to the same path. Folders and
files are created with the default modes, so they follow the umask.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import time
from collections.abc import Callable
from pathlib import Path

from stagewise.compiler.checkpoint.files import (
    MARKER,
    FileRecord,
    foreign_entries,
    marker_text,
    remove_own_folder,
)
from stagewise.ir.errors import CheckpointError

STALE_AFTER_S = 3600.0  # a staging folder this old is a dead save's even if its pid is alive again
_IN_USE: set[Path] = set()  # this process's staging folders of saves still running


def previous_path(target: Path) -> Path:
    """Where the old checkpoint is while the new one is renamed into place: beside `target`, named
    after it ('.' and '..', which have no name of their own, spelt out first)."""
    named = Path(os.path.abspath(target)) if target.name in ("", "..") else target
    return named.with_name(f".{named.name}.old")


def publish(target: Path, fill: Callable[[Path], dict[str, FileRecord]]) -> None:
    """Write a checkpoint with `fill` (which writes the files into the folder it is given and says
    what it wrote) and put it at `target`; refuses a target that is not a checkpoint or empty."""
    staging, replacing = begin(target)
    try:
        complete(staging, target, replacing, fill(staging))
    except BaseException:
        abandon(staging)
        raise


def begin(target: Path) -> tuple[Path, bool]:
    """A new staging folder for a checkpoint at `target`, and whether one is there to replace
    (CheckpointError where `target` holds anything else); finish with `complete` or `abandon`."""
    target.parent.mkdir(parents=True, exist_ok=True)
    replacing = _check_target(target)
    _remove_dead_staging(target)
    staging = _new_staging(target)
    _IN_USE.add(staging)
    return staging, replacing


def complete(staging: Path, target: Path, replacing: bool, files: dict[str, FileRecord]) -> None:
    """Mark the staging folder complete (`files`: everything written into it) and swap it in."""
    try:
        put(staging / MARKER, marker_text(files))
        sync_directory(staging)
        _swap(staging, target, replacing)
    finally:
        _IN_USE.discard(staging)


def abandon(staging: Path) -> None:
    """Remove a staging folder whose save failed."""
    _IN_USE.discard(staging)
    with contextlib.suppress(OSError, CheckpointError):
        remove_own_folder(staging)


def put(path: Path, data: str | bytes) -> FileRecord:
    """Write a file and flush it to the disk, so the rename never publishes data still in flight."""
    raw = data.encode() if isinstance(data, str) else data
    with open(path, "wb") as file:
        file.write(raw)
        file.flush()
        os.fsync(file.fileno())
    return FileRecord.of(raw)


def sync_directory(path: Path) -> None:
    """Make a directory's entries (the files in it, a rename into it) durable, where the OS allows."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _check_target(target: Path) -> bool:
    """Whether a checkpoint is at `target` to be replaced; raises if something else is there."""
    fix = "save to a new or empty directory, or move those files out of the way"
    if target.is_symlink():
        raise CheckpointError(f"cannot save to {target}: it is a symbolic link; save to {target.resolve()} itself")
    if target.exists() and not target.is_dir():
        raise CheckpointError(f"cannot save to {target}: it is a file, not a directory; {fix}")
    previous = previous_path(target)
    if previous.exists() and (previous.is_symlink() or not previous.is_dir() or foreign_entries(previous)):
        raise CheckpointError(f"cannot save to {target}: {previous}, where the old checkpoint goes, is not one; {fix}")
    if not target.exists():
        return False
    foreign = foreign_entries(target)
    if foreign:
        raise CheckpointError(
            f"cannot save to {target}: it holds files that are not part of a stagewise checkpoint "
            f"({', '.join(foreign[:5])}{', ...' if len(foreign) > 5 else ''}); {fix}"
        )
    if not any(target.iterdir()):
        return False
    if not (target / MARKER).is_file():  # a damaged marker is still a checkpoint's: saving again repairs it
        raise CheckpointError(f"cannot save to {target}: it is not a stagewise checkpoint ({MARKER} is missing); {fix}")
    return True


def _swap(staging: Path, target: Path, replacing: bool) -> None:
    """Rename the finished checkpoint into place; the old one is removed only once the new one is there."""
    previous = previous_path(target)
    if replacing:
        if previous.exists():  # left by an interrupted save, while a complete checkpoint is at the target
            remove_own_folder(previous)
        os.replace(target, previous)
    try:
        os.replace(staging, target)  # onto a missing or empty directory
    except BaseException:
        if replacing:
            with contextlib.suppress(OSError):
                os.replace(previous, target)
        raise
    sync_directory(target.parent)
    with contextlib.suppress(OSError):  # the new checkpoint is in place; a leftover goes at the next save
        if previous.exists():
            remove_own_folder(previous)


def _staging_prefix(target: Path) -> str:
    return f".{target.name}.saving."


def _new_staging(target: Path) -> Path:
    """A fresh staging folder beside `target`, named so that its owner and age can be told."""
    name = f"{_staging_prefix(target)}{os.getpid()}.{int(time.time())}.{secrets.token_hex(4)}.{socket.gethostname()}"
    staging = target.with_name(name)
    os.mkdir(staging)  # the default mode, so the umask applies
    return staging


def _remove_dead_staging(target: Path) -> None:
    """Remove the staging folders that saves to `target` left when they died."""
    prefix = _staging_prefix(target)
    for entry in os.scandir(target.parent):
        path = Path(entry.path)
        if entry.name.startswith(prefix) and entry.is_dir(follow_symlinks=False) and _is_dead(path, prefix):
            with contextlib.suppress(OSError, CheckpointError):  # another save removing it too, or not ours
                remove_own_folder(path)


def _is_dead(staging: Path, prefix: str) -> bool:
    """Whether the save that owns `staging` is over: its process is gone, or it is over an hour old."""
    try:
        pid_text, seconds, _token, host = staging.name[len(prefix):].split(".", 3)
        pid, started = int(pid_text), int(seconds)
    except ValueError:
        return False  # not a name this module gives
    if time.time() - started > STALE_AFTER_S:
        return True
    if host != socket.gethostname():
        return False  # another machine's save, on a shared filesystem: only its age tells
    if pid == os.getpid():
        return staging not in _IN_USE
    return not _process_alive(pid)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True
