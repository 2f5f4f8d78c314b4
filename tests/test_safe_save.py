"""pipe.save never removes what is not its own checkpoint, survives a crash at any moment, cleans up
after dead saves and follows the umask; sw.load checks every file of a checkpoint."""

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import stagewise as sw
from stagewise.compiler.checkpoint import swap as checkpoint_swap
from tests.models.mlp import mlp
from tests.reference import SGD, assert_state_equal

X, Y = torch.randn(4, 8), torch.randint(0, 5, (4,))
STAGE_FILES = ["plan.json", "graph.json", "programs.txt", "training.pt", "stage_0.py", "stage_0.json", "stage_1.py", "stage_1.json",
               "weights/__0_0.distcp", "weights/.metadata"]
FILES = [*STAGE_FILES, "stagewise.json"]
TOP_LEVEL = sorted({name.split("/")[0] for name in FILES})


@pytest.fixture(scope="module")
def pipe():
    torch.manual_seed(0)
    return sw.compile(mlp(), 2, (X,), loss_fn=torch.nn.functional.cross_entropy, example_target=Y,
                      optimizer=SGD, microbatches=2, cost="analytic")


def snapshot(directory: Path) -> dict[str, bytes | None]:
    """Every entry under `directory` by relative path: a file's bytes, None for a folder."""
    return {str(p.relative_to(directory)): (p.read_bytes() if p.is_file() else None) for p in directory.rglob("*")}


def state(pipe) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in pipe.state_dict().items()}


def loaded_state(path: Path) -> dict[str, torch.Tensor]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return sw.load(path).state_dict()


def same(got: dict, want: dict) -> bool:
    return set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


# --- refusing what is not a checkpoint ---------------------------------------------------------------------------


def test_saving_over_a_user_folder_refuses_and_leaves_it_untouched(pipe, tmp_path):
    target = tmp_path / "runs"
    (target / "tensorboard").mkdir(parents=True)
    (target / "notes.txt").write_text("do not lose me")
    (target / "tensorboard" / "events.out").write_bytes(b"\x00\x01")
    before = snapshot(tmp_path)
    with pytest.raises(sw.CheckpointError, match=r"not part of a stagewise checkpoint \(notes.txt, tensorboard\)"):
        pipe.save(target)
    assert snapshot(tmp_path) == before  # nothing removed, no staging folder left


def test_saving_over_a_file_refuses(pipe, tmp_path):
    target = tmp_path / "ck"
    target.write_text("a file")
    with pytest.raises(sw.CheckpointError, match="it is a file, not a directory"):
        pipe.save(target)
    assert target.read_text() == "a file" and [p.name for p in tmp_path.iterdir()] == ["ck"]


def test_saving_over_a_folder_that_only_looks_like_a_checkpoint_refuses(pipe, tmp_path):
    target = tmp_path / "ck"
    target.mkdir()
    (target / "plan.json").write_text("{}")  # the names of checkpoint files, but no stagewise marker
    with pytest.raises(sw.CheckpointError, match="stagewise.json is missing"):
        pipe.save(target)
    assert snapshot(tmp_path) == {"ck": None, "ck/plan.json": b"{}"}


def test_saving_over_a_checkpoint_the_user_added_files_to_refuses(pipe, tmp_path):
    target = tmp_path / "ck"
    pipe.save(target)
    (target / "README").write_text("my notes")
    before = snapshot(tmp_path)
    with pytest.raises(sw.CheckpointError, match=r"\(README\)"):
        pipe.save(target)
    assert snapshot(tmp_path) == before


def test_a_user_folder_where_the_old_checkpoint_goes_refuses(pipe, tmp_path):
    (tmp_path / ".ck.old").mkdir()
    (tmp_path / ".ck.old" / "mine.txt").write_text("mine")
    with pytest.raises(sw.CheckpointError, match=re.escape(".ck.old, where the old checkpoint goes, is not one")):
        pipe.save(tmp_path / "ck")
    assert snapshot(tmp_path) == {".ck.old": None, ".ck.old/mine.txt": b"mine"}


def test_saving_into_an_empty_folder_and_over_its_own_checkpoint(pipe, tmp_path):
    target = tmp_path / "ck"
    target.mkdir()
    pipe.save(target)
    pipe.save(target)
    assert sorted(p.name for p in target.iterdir()) == TOP_LEVEL
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]
    assert_state_equal(loaded_state(target), pipe.state_dict())


def test_saving_over_a_damaged_checkpoint_repairs_it(pipe, saved, tmp_path):
    target = tmp_path / "ck"
    shutil.copytree(saved, target)
    damage(target / "stagewise.json", "truncated")
    damage(target / "stage_1.json", "missing")
    pipe.save(target)
    assert_state_equal(loaded_state(target), pipe.state_dict())


# --- a crash at any moment ---------------------------------------------------------------------------------------


class Crash(BaseException):
    """The process died here: nothing after it runs, not even clean-up handlers' file operations."""


FILE_OPERATIONS = [(os, n) for n in ("replace", "rename", "unlink", "rmdir", "mkdir", "fsync", "open")] + [
    (shutil, "rmtree")
]


def inject_crash(monkeypatch, at: int | None) -> list[str]:
    """Count the file operations of a save (names in order); with `at`, die at the at-th."""
    calls: list[str] = []

    def wrap(name, real):
        def operation(*args, **kwargs):
            calls.append(name)
            if at is not None and len(calls) >= at:
                raise Crash(f"killed at file operation {len(calls)} ({name})")
            return real(*args, **kwargs)

        return operation

    for owner, name in FILE_OPERATIONS:
        monkeypatch.setattr(owner, name, wrap(name, getattr(owner, name)))
    monkeypatch.setattr(checkpoint_swap, "open", wrap("open file", open), raising=False)
    return calls


@pytest.mark.parametrize("previous", [True, False], ids=["over-a-checkpoint", "new-path"])
def test_a_crash_between_any_two_file_operations_leaves_the_old_or_the_new_checkpoint(pipe, tmp_path, previous):
    old_state = state(pipe)
    template = tmp_path / "template"
    pipe.save(template)
    pipe.step(X, target=Y)
    new_state = state(pipe)
    assert not same(new_state, old_state)
    if previous:
        shutil.copytree(template, tmp_path / "counted" / "ck")
    with pytest.MonkeyPatch.context() as patch:
        counted = inject_crash(patch, None)
        pipe.save(tmp_path / "counted" / "ck")
        count = len(counted)
    assert count > 10, counted
    seen = set()
    for k in range(1, count + 1):
        parent = tmp_path / f"crash{k}"
        parent.mkdir()
        target = parent / "ck"
        if previous:
            shutil.copytree(template, target)
        with pytest.MonkeyPatch.context() as patch:
            calls = inject_crash(patch, k)
            with pytest.raises(BaseException, match="killed at file operation"):  # DCP wraps what kills its writes
                pipe.save(target)
        got = loaded_state(target) if previous or target.exists() else None
        outcome = "new" if got is not None and same(got, new_state) else "old" if got is not None else "none"
        assert outcome == "new" or (outcome == "old" and previous) or (outcome == "none" and not previous), (
            f"crash at {calls[-1]} #{k}: {outcome}"
        )
        seen.add(outcome)
        pipe.save(target)  # the next save finishes the job and removes what the dead one left
        assert [p.name for p in parent.iterdir()] == ["ck"], f"crash at {calls[-1]} #{k}"
        assert same(loaded_state(target), new_state)
    assert seen == ({"old", "new"} if previous else {"none", "new"})


def test_load_finds_the_previous_checkpoint_a_crash_left_beside_the_path(pipe, tmp_path):
    target = tmp_path / "ck"
    pipe.save(target)
    os.replace(target, tmp_path / ".ck.old")  # where a save dying between its two renames leaves it
    with pytest.warns(UserWarning, match=r"interrupted.*loading the previous checkpoint from .*\.ck\.old"):
        loaded = sw.load(target)
    assert_state_equal(loaded.state_dict(), pipe.state_dict())
    pipe.save(target)
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]


# --- staging folders of dead saves -------------------------------------------------------------------------------


def staging(parent: Path, pid: int, started: float, *, host: str | None = None, content=("plan.json",)) -> Path:
    folder = parent / f".ck.saving.{pid}.{int(started)}.beef.{host or socket.gethostname()}"
    folder.mkdir()
    for name in content:
        (folder / name).write_text("partial")
    return folder


def test_staging_folders_of_dead_saves_are_removed_by_the_next_save(pipe, tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid, live_pid, now = int(dead.stdout), os.getppid(), time.time()
    removed = [
        staging(tmp_path, dead_pid, now),  # its process is gone
        staging(tmp_path, live_pid, now - 2 * 3600),  # over an hour old: the pid was reused
        staging(tmp_path, live_pid, now - 2 * 3600, host="elsewhere"),
        staging(tmp_path, dead_pid, now - 60, content=()),
    ]
    kept = [
        staging(tmp_path, live_pid, now),  # a save running now in another process
        staging(tmp_path, dead_pid, now, host="elsewhere"),  # another machine's, under an hour old
        staging(tmp_path, dead_pid, now - 2 * 3600, content=("plan.json", "notes.txt")),  # not only ours
    ]
    (tmp_path / ".ck.notes").mkdir()  # not a staging name
    pipe.save(tmp_path / "ck")
    left = {p.name for p in tmp_path.iterdir()}
    assert not left & {p.name for p in removed}
    assert left == {p.name for p in kept} | {".ck.notes", "ck"}


# --- modes follow the umask --------------------------------------------------------------------------------------


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077, 0o002])
def test_files_and_folders_follow_the_umask(pipe, tmp_path, umask):
    previous = os.umask(umask)
    try:
        pipe.save(tmp_path / "new" / "ck")
        pipe.save(tmp_path / "new" / "ck")  # replacing keeps following it
    finally:
        os.umask(previous)
    for folder in (tmp_path / "new", tmp_path / "new" / "ck"):
        assert folder.stat().st_mode & 0o777 == 0o777 & ~umask, folder
    for file in (tmp_path / "new" / "ck").rglob("*"):
        assert file.stat().st_mode & 0o777 == (0o777 if file.is_dir() else 0o666) & ~umask, file


# --- every file checked on load ----------------------------------------------------------------------------------


def damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "missing":
        path.unlink()
    elif how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    else:  # one byte flipped
        middle = len(data) // 2
        path.write_bytes(data[:middle] + bytes([data[middle] ^ 0x5A]) + data[middle + 1:])


@pytest.fixture(scope="module")
def saved(pipe, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("saved") / "ck"
    pipe.save(directory)
    return directory


@pytest.mark.parametrize("how", ["missing", "truncated", "corrupted"])
@pytest.mark.parametrize("name", FILES)
def test_a_damaged_checkpoint_file_is_an_error_naming_it(saved, tmp_path, name, how):
    target = tmp_path / "ck"
    shutil.copytree(saved, target)
    damage(target / name, how)
    phrase = {"missing": "is missing", "truncated": "is truncated", "corrupted": "is corrupted"}[how]
    if name == "stagewise.json" and how == "truncated":
        phrase = "is corrupted"  # half a JSON document
    with pytest.raises(sw.CheckpointError, match=re.escape(f"{target / name} {phrase}")) as raised:
        sw.load(target)
    assert isinstance(raised.value, sw.StagewiseError)


def test_a_whole_file_this_stagewise_cannot_use_names_itself(saved, tmp_path):
    """A stage structure that is intact (its digest matches) but of a format this stagewise does not know."""
    import hashlib
    import json

    target = tmp_path / "ck"
    shutil.copytree(saved, target)
    structure = b'{"format": "stagewise.stage/99"}'
    (target / "stage_1.json").write_bytes(structure)
    marker = json.loads((target / "stagewise.json").read_text())
    marker["files"]["stage_1.json"] = {"bytes": len(structure), "sha256": hashlib.sha256(structure).hexdigest()}
    marker["files_sha256"] = hashlib.sha256(json.dumps(marker["files"], sort_keys=True).encode()).hexdigest()
    (target / "stagewise.json").write_text(json.dumps(marker))
    with pytest.raises(sw.CheckpointError, match=re.escape(f"{target / 'stage_1.json'} is whole but cannot be used")):
        sw.load(target)


@pytest.mark.parametrize(("version", "message"), [
    (99, "newer stagewise .*upgrade stagewise"),
    (1, "format 1 of an earlier stagewise, which stored code"),  # pickled stages and factory, run on load
])
def test_a_checkpoint_of_another_format_says_what_to_do(saved, tmp_path, version, message):
    target = tmp_path / "ck"
    shutil.copytree(saved, target)
    marker = target / "stagewise.json"
    marker.write_text(marker.read_text().replace('"version": 2', f'"version": {version}'))
    with pytest.raises(sw.CheckpointError, match=message):
        sw.load(target)


def test_loading_what_is_not_a_checkpoint(tmp_path):
    with pytest.raises(sw.CheckpointError, match="it does not exist"):
        sw.load(tmp_path / "nowhere")
    (tmp_path / "file").write_text("x")
    with pytest.raises(sw.CheckpointError, match="it is not a directory"):
        sw.load(tmp_path / "file")
    with pytest.raises(sw.CheckpointError, match="plan.json is missing"):
        sw.load(tmp_path)
