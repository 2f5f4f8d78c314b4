"""Opening a checkpoint's files so that a crafted checkpoint reads nothing outside its folder.

Anyone may have written a checkpoint, its marker included (sizes and SHA-256 are no secret), so
every name a checkpoint holds (the marker's file names, DCP's shard names) is checked to be a
plain relative name before it is opened, and every file is opened without following a symbolic
link (`O_NOFOLLOW`, the folder walked one `dir_fd` at a time) and without blocking (`O_NONBLOCK`:
opening a FIFO returns at once), then refused unless `fstat` says it is a regular file. So a
name `../../secret`, a link to `/dev/zero` or a FIFO is a CheckpointError naming it, never a
read outside the folder or a hang.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from stagewise.ir.errors import CheckpointError

_PART = re.compile(r"[A-Za-z0-9_.-]{1,255}")  # one component of a name: no slash, backslash, NUL or space
_NOT_PARTS = (".", "..")
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0)
_REFUSED = "a checkpoint holds only regular files and its weights folder: save the pipeline again"


def plain_name(name: object, where: object) -> str:
    """`name` if it is a relative name of plain components inside the folder (no `..`, no
    absolute path, no empty part, no backslash or NUL), else a CheckpointError naming `where`."""
    parts = name.split("/") if isinstance(name, str) else []
    if not parts or not all(_PART.fullmatch(p) and p not in _NOT_PARTS for p in parts):
        raise CheckpointError(f"{where} names the file {name!r}, which is not a plain name inside the checkpoint "
                              f"folder: stagewise refuses to open it; {_REFUSED}")
    return str(name)


def check_folder(root: Path, inner: str) -> None:
    """`root` is a real directory (not a link to one), and it and its folder `inner` (weights/)
    hold no links, FIFOs, devices or sockets."""
    with _directory(root, "") as fd:
        _check_entries(root, fd, "")
        if inner in os.listdir(fd):
            with _directory(root, inner) as nested:
                _check_entries(root, nested, inner + "/")


def _check_entries(root: Path, fd: int, prefix: str) -> None:
    """Every entry of the directory `fd` is a regular file or a directory."""
    for name in os.listdir(fd):
        mode = os.lstat(name, dir_fd=fd).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise CheckpointError(f"{root / (prefix + name)} is a {_kind(mode)}: stagewise follows no link and reads "
                                  f"no special file in a checkpoint; {_REFUSED}")


def read_file(root: Path, name: str, size: int) -> bytes:
    """The bytes of the regular file `root / name`, once `fstat` says it is `size` bytes long."""
    with open_file(root, name) as fd:
        check_size(root / name, os.fstat(fd).st_size, size)
        chunks, left = [], size
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 24))):
            chunks.append(chunk)
            left -= len(chunk)
        check_size(root / name, size - left, size)  # shortened while it was read
        return b"".join(chunks)


def check_size(path: Path, got: int, want: int) -> None:
    """A file of `got` bytes where the marker says `want` is truncated or too long."""
    if got != want:
        raise CheckpointError(f"{path} is {'truncated' if got < want else 'too long'}: {got} bytes where {want} were "
                              "saved; save the pipeline again, or restore the directory from a copy")


@contextmanager
def open_file(root: Path, name: str) -> Iterator[int]:
    """A descriptor of the regular file `root / name`: each folder on the way opened without
    following links, the file too, and refused unless it is a regular file."""
    *folders, last = plain_name(name, root / "stagewise.json").split("/")
    with _directory(root, "/".join(folders)) as parent:
        fd = _open(last, _FILE_FLAGS, parent, root / name)
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise CheckpointError(f"{root / name} is a {_kind(mode)}, not a regular file: stagewise reads no "
                                      f"special file in a checkpoint; {_REFUSED}")
            yield fd
        finally:
            os.close(fd)


@contextmanager
def _directory(root: Path, inner: str) -> Iterator[int]:
    """A descriptor of the folder `root / inner`, opened one component at a time, `root`'s last
    component included, none of them through a link."""
    fd = _open(str(root), _DIR_FLAGS, None, root)
    try:
        for part in [p for p in inner.split("/") if p]:
            nested = _open(part, _DIR_FLAGS, fd, root / inner)
            os.close(fd)
            fd = nested
        yield fd
    finally:
        os.close(fd)


def _open(name: str, flags: int, folder: int | None, path: Path) -> int:
    """`os.open`, its failures told as CheckpointErrors naming `path`."""
    try:
        return os.open(name, flags, dir_fd=folder)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing from the checkpoint; save the pipeline again, or restore the "
                              "directory from a copy") from None
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
            raise CheckpointError(f"{path} is a symbolic link or not a directory: stagewise follows no link in a "
                                  f"checkpoint; give the folder itself, or {_REFUSED}") from None
        raise CheckpointError(f"{path} cannot be read ({error}); check its permissions") from error


def _kind(mode: int) -> str:
    kinds = ((stat.S_ISLNK, "symbolic link"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"),
             (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket"), (stat.S_ISDIR, "directory"))
    return next((kind for test, kind in kinds if test(mode)), "special file")


def strict_json(data: bytes | str, where: Path) -> object:
    """`json.loads`, refusing an object that repeats a key (json would keep the last silently)."""
    def unique(pairs: list[tuple[str, object]]) -> dict:
        keys = [k for k, _ in pairs]
        if len(set(keys)) != len(keys):
            twice = next(k for k in keys if keys.count(k) > 1)
            raise CheckpointError(f"{where} holds the key {twice!r} twice in one object: a checkpoint stagewise wrote "
                                  "never does; save the pipeline again")
        return dict(pairs)

    return json.loads(data, object_pairs_hook=unique)
