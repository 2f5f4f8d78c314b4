"""What makes a directory a stagewise checkpoint, and the checks that every file of one is whole.

A checkpoint holds a marker, stagewise.json, written last: the format version and, for every
other file, its size and SHA-256. Save replaces or removes only folders it can recognise as its
own (the marker, or only checkpoint file names under a name of its own), never a user's; load
checks every file it reads against the marker, so a missing, truncated or corrupted file is an
error naming that file, not a raw unpickling or import failure.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from stagewise.compiler.checkpoint.paths import (
    check_folder,
    check_size,
    open_file,
    plain_name,
    read_file,
    strict_json,
)
from stagewise.ir.errors import CheckpointError

MARKER = "stagewise.json"
FORMAT = "stagewise-checkpoint"
VERSION = 2  # 1: pickled stages and optimizer factory, executed on load; 2: DCP weights, no code
_OWN_FILE = re.compile(r"plan\.json|graph\.json|programs\.txt|training\.pt|runtime\.pt|stage_\d+\.(py|pt|json)|stagewise\.json")
WEIGHTS_DIR = "weights"  # a DCP checkpoint: rank shards and DCP's metadata
_OWN_WEIGHTS = re.compile(r"__\d+_\d+\.distcp|\.metadata(\.tmp)?")  # .tmp: DCP before its rename
_CHUNK = 1 << 24
_BYTECODE = "__pycache__"  # where importing a stage's source may cache its bytecode
_OWN_BYTECODE = re.compile(r"stage_\d+\..*\.pyc")
_MARKER_LIMIT = 1 << 24
_SHA256 = re.compile(r"[0-9a-f]{64}")
_DAMAGED = "save the pipeline again, or restore the directory from a copy"


@dataclass(frozen=True)
class FileRecord:
    """What the marker says of one file: its size and SHA-256 when it was written."""

    size: int
    sha256: str

    @staticmethod
    def of(data: bytes) -> FileRecord:
        return FileRecord(len(data), hashlib.sha256(data).hexdigest())

    @staticmethod
    def of_file(path: Path) -> FileRecord:
        """The record of a file read in chunks (a weights shard may not fit in memory twice)."""
        digest, size = hashlib.sha256(), 0
        with open(path, "rb") as file:
            while chunk := file.read(_CHUNK):
                digest.update(chunk)
                size += len(chunk)
        return FileRecord(size, digest.hexdigest())


def folder_records(root: Path, folder: str) -> dict[str, FileRecord]:
    """The records of every file in `root / folder`, by their names relative to `root`."""
    return {f"{folder}/{p.name}": FileRecord.of_file(p) for p in sorted((root / folder).iterdir()) if p.is_file()}


def marker_text(files: dict[str, FileRecord]) -> str:
    """The marker of a checkpoint made of `files`."""
    listed = {name: {"bytes": r.size, "sha256": r.sha256} for name, r in sorted(files.items())}
    marker = {"format": FORMAT, "version": VERSION, "files": listed, "files_sha256": _digest_of(listed)}
    return json.dumps(marker, indent=1) + "\n"


def _digest_of(listed: dict) -> str:
    """The marker's own check: a changed size or digest in it is corruption, not a changed file."""
    return hashlib.sha256(json.dumps(listed, sort_keys=True).encode()).hexdigest()


def read_marker(root: Path) -> dict[str, FileRecord]:
    """The files the checkpoint at `root` was written with, by name (each a plain name inside
    `root`: checkpoint_paths.py), once `root` holds no links or special files."""
    path = root / MARKER
    if not root.is_dir():
        why = "it is not a directory" if root.exists() else "it does not exist"
        raise CheckpointError(f"{root} holds no stagewise checkpoint ({why})")
    check_folder(root, WEIGHTS_DIR)
    if not path.is_file():
        if not (root / "plan.json").exists():
            raise CheckpointError(f"{root} holds no stagewise checkpoint (plan.json is missing)")
        raise CheckpointError(f"{path} is missing: {root} is not a complete stagewise checkpoint; {_DAMAGED}")
    try:
        data = strict_json(_marker_bytes(root), path)
        if not isinstance(data, dict):
            raise ValueError(f"a JSON {type(data).__name__}, not an object")
        if data["format"] != FORMAT:
            raise ValueError(f"format {data['format']!r}")
        version = int(data["version"])
        if _digest_of(data["files"]) != data["files_sha256"]:
            raise ValueError("its list of files does not match its own SHA-256")
        files = {plain_name(n, path): _record(r) for n, r in data["files"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise CheckpointError(f"{path} is corrupted ({type(error).__name__}: {error}); {_DAMAGED}") from error
    if version < VERSION:
        raise CheckpointError(
            f"{root} is in checkpoint format {version} of an earlier stagewise, which stored code that loading "
            f"would run; this one reads format {VERSION} only: load it with the stagewise that wrote it, restore "
            "it into a compiled pipeline there and save it again with this one, or train from the weights"
        )
    if version > VERSION:
        raise CheckpointError(
            f"{root} was written by a newer stagewise (checkpoint format {version}, this one reads up to "
            f"{VERSION}); upgrade stagewise to load it"
        )
    return files


def _marker_bytes(root: Path) -> bytes:
    """The marker's bytes; one larger than any marker stagewise writes is refused unread."""
    with open_file(root, MARKER) as fd:
        size = os.fstat(fd).st_size
    if size > _MARKER_LIMIT:
        raise CheckpointError(f"{root / MARKER} is {size} bytes, more than a marker of any checkpoint ({_MARKER_LIMIT}); "
                              f"{_DAMAGED}")
    return read_file(root, MARKER, size)


def _record(entry: object) -> FileRecord:
    """A marker's entry of one file: a size that is a non-negative int, a SHA-256 in hex."""
    if not isinstance(entry, dict) or type(entry.get("bytes")) is not int or entry["bytes"] < 0:
        raise ValueError(f"the file entry {entry!r} has no size")
    if not (isinstance(entry.get("sha256"), str) and _SHA256.fullmatch(entry["sha256"])):
        raise ValueError(f"the file entry {entry!r} has no SHA-256")
    return FileRecord(entry["bytes"], entry["sha256"])


def read_checked(root: Path, name: str, files: dict[str, FileRecord]) -> bytes:
    """The bytes of `root / name`, once they are what the checkpoint wrote."""
    path = root / name
    if name not in files:
        raise CheckpointError(f"{root / MARKER} does not list {name}, which the plan needs; {_DAMAGED}")
    want = files[name]
    data = read_file(root, name, want.size)
    if FileRecord.of(data) != want:
        raise CheckpointError(f"{path} is corrupted: its contents differ from what was saved (SHA-256); {_DAMAGED}")
    return data


def check_file(root: Path, name: str, files: dict[str, FileRecord]) -> None:
    """`read_checked` for a file another reader opens (a weights shard), read in chunks."""
    path = root / name
    if name not in files:
        raise CheckpointError(f"{root / MARKER} does not list {name}; {_DAMAGED}")
    want = files[name]
    digest, size = hashlib.sha256(), 0
    with open_file(root, name) as fd:
        check_size(path, os.fstat(fd).st_size, want.size)
        while chunk := os.read(fd, _CHUNK):
            digest.update(chunk)
            size += len(chunk)
    if FileRecord(size, digest.hexdigest()) != want:
        raise CheckpointError(f"{path} is corrupted: its contents differ from what was saved (SHA-256); {_DAMAGED}")


def foreign_entries(path: Path) -> list[str]:
    """The entries of directory `path` that no checkpoint writes (a user's files)."""
    foreign = []
    for entry in os.scandir(path):
        if entry.name == _BYTECODE and entry.is_dir(follow_symlinks=False):
            foreign += [f"{_BYTECODE}/{n}" for n in os.listdir(entry.path) if not _OWN_BYTECODE.fullmatch(n)]
        elif entry.name == WEIGHTS_DIR and entry.is_dir(follow_symlinks=False):
            foreign += [f"{WEIGHTS_DIR}/{n}" for n in os.listdir(entry.path) if not _OWN_WEIGHTS.fullmatch(n)]
        elif not (_OWN_FILE.fullmatch(entry.name) and entry.is_file(follow_symlinks=False)):
            foreign.append(entry.name)
    return sorted(foreign)


def remove_own_folder(path: Path) -> None:
    """Remove a folder of checkpoint files, the marker last (so a folder interrupted half-way is
    still recognisably a checkpoint's); refuses one that holds anything else."""
    foreign = foreign_entries(path)
    if foreign:
        raise CheckpointError(f"{path} holds files stagewise did not write ({', '.join(foreign)}); it was left as it is")
    for inner in (path / _BYTECODE, path / WEIGHTS_DIR):
        if inner.is_dir():
            for name in os.listdir(inner):
                os.unlink(inner / name)
            os.rmdir(inner)
    for name in sorted(os.listdir(path), key=lambda n: n == MARKER):
        os.unlink(path / name)
    os.rmdir(path)
