"""The `stagewise` command line, run as a user runs it (the console script and `python -m stagewise`):
`plan` from a Hugging Face config file and from `module:factory`, printing the plan and writing its
timeline; `recommend` under constraints; `inspect` of a saved checkpoint, checked as `sw.load` checks it;
and every error a user can cause as one line on stderr, exit status 2, no traceback.

Each entry point runs as a fresh process once or more (the console script, `python -m stagewise`);
the other commands run through `main` in this process, which both entry points call: a fresh
interpreter spends about 4 CPU-seconds importing torch and stagewise before it starts."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import stagewise as sw
from stagewise.cli.errors import CommandLineError
from stagewise.cli.main import build_parser, main
from stagewise.cli.models import load_workload
from stagewise.ir.errors import CheckpointError
from tests.harness.cli import stagewise_here
from tests.harness.crafted import crafted, with_node
from tests.models.gpt import TinyGPT, lm_loss

ROOT = Path(__file__).resolve().parents[1]
CONSOLE_SCRIPT = Path(sys.executable).with_name("stagewise")  # installed by `pip install -e .`
GPT2_CONFIG = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 2, "n_embd": 64, "n_head": 4,
               "vocab_size": 1000, "n_positions": 128, "bos_token_id": 0, "eos_token_id": 0}


def stagewise(*args: str | Path, script: bool = False) -> subprocess.CompletedProcess:
    """The command, run from the repository root (where `tests.cli_factories` is importable)."""
    command = [str(CONSOLE_SCRIPT)] if script else [sys.executable, "-m", "stagewise"]
    return subprocess.run([*command, *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          check=False)


@pytest.fixture(scope="module")
def gpt2_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gpt2") / "config.json"
    path.write_text(json.dumps(GPT2_CONFIG))
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small pipeline on two CPU devices, saved."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 64, (8, 16))
    pipe = sw.compile(TinyGPT(layers=2), ["cpu", "cpu"], (tokens,), loss_fn=lm_loss, example_target=tokens,
                      cost="analytic", schedule="1f1b", microbatches=2)
    path = tmp_path_factory.mktemp("saved") / "ckpt"
    pipe.save(path)
    return path


def test_console_script_plans_a_hugging_face_config_and_writes_the_timeline(gpt2_config: Path, tmp_path: Path):
    trace, png = tmp_path / "plan.json", tmp_path / "plan.png"
    run = stagewise("plan", gpt2_config, "--devices", "4xH100", "--seq-len", "64", "--precision", "bf16",
                    "--trace", trace, "--png", png, script=True)
    assert run.returncode == 0, run.stderr
    assert "devices: 4xH100 (4, datasheet figures); links: sw.plan's default per device kind" in run.stdout
    assert "stagewise plan: GPT2LMHeadModel" in run.stdout and "plans considered:" in run.stdout
    assert "precision: bf16" in run.stdout
    assert re.search(r"where the time goes \(dev\d, the busiest\): compute [<\d]+%.* — bound: \w+", run.stdout)
    events = json.loads(trace.read_text())["traceEvents"]
    assert {"F", "B"} <= {event["name"][0] for event in events if event["ph"] == "X"}
    assert png.read_bytes().startswith(b"\x89PNG")
    assert f"wrote {trace}" in run.stdout and f"wrote {png}" in run.stdout


def test_plans_a_module_factory_with_its_own_batch_and_loss_on_an_instance_type(capsys: pytest.CaptureFixture):
    status, out, err = stagewise_here(capsys, "plan", "tests.cli_factories:tiny_gpt", "--devices", "g4dn.12xlarge",
                                      "--schedule", "1f1b", "--microbatches", "2", "--optimizer", "sgd")
    assert status == 0, err
    assert "links: 15.75 GB/s (the catalogue's)" in out  # the instance type's, not the default
    assert "stagewise plan: TinyGPT (" in out and "1f1b, 2 microbatches of 4)" in out
    assert "tied-parameter" in out  # its loss_fn and target were used: the tied head is the last stage's


def test_a_factory_returning_only_a_model_gets_random_token_ids():
    workload = load_workload("tests.cli_factories:hf_gpt2", batch=4, seq_len=16)
    ids = workload.example_inputs["input_ids"]
    assert ids.shape == (4, 16) and ids.max() < workload.model.config.vocab_size
    assert workload.example_inputs["labels"] is ids and workload.loss_fn is None


def test_recommend_ranks_the_candidates_and_exits_1_when_none_meets_the_budget(gpt2_config: Path,
                                                                              capsys: pytest.CaptureFixture):
    status, out, err = stagewise_here(capsys, "recommend", gpt2_config, "--candidates", "1xH100-SXM-80GB,p3.2xlarge",
                                      "--seq-len", "32", "--steps", "1000", "--budget", "0.000001")
    assert status == 1, err
    assert "1xH100-SXM-80GB" in out and "p3.2xlarge" in out
    assert re.search(r"│ +[<\d]+(/[<\d]+){4} │ +(compute|PCIe|network) │", out)  # the row's split and bound
    assert "no candidate meets every constraint: budget" in out


def test_recommend_reads_its_constraints():
    args = build_parser().parse_args(["recommend", "m:f", "--candidates", "8xH100,2xp4d.24xlarge", "--candidates",
                                      "A100", "--deadline", "36h", "--budget", "500", "--steps", "10000",
                                      "--objective", "time", "--precision", "bf16"])
    assert (args.deadline, args.budget, args.steps, args.objective) == (36 * 3600, 500.0, 10000, "time")
    assert args.candidates == ["8xH100,2xp4d.24xlarge", "A100"]
    assert build_parser().parse_args(["recommend", "m:f", "--deadline", "90min"]).deadline == 5400


def copied(checkpoint: Path, tmp_path: Path) -> Path:
    """A copy of the checkpoint for a test to damage."""
    copy = tmp_path / "ckpt"
    copy.mkdir()
    for file in checkpoint.iterdir():
        if file.is_file():
            (copy / file.name).write_bytes(file.read_bytes())
    return copy


def test_inspect_shows_the_plan_programs_and_the_code_load_runs(checkpoint: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture):
    """The code shown is torch.fx's for each stage rebuilt from stage_<i>.json, which sw.load runs:
    a stage_<i>.py rewritten (its marker entry too) to look harmless is not what is shown."""
    shown = crafted(checkpoint, tmp_path, "stage_1.py", lambda _: b"# looks clean\n")
    status, out, err = stagewise_here(capsys, "inspect", shown)
    assert status == 0, err
    assert "stagewise plan: TinyGPT (" in out and "1f1b, 2 microbatches of 4)" in out
    assert "program dev0" in out and "program dev1" in out
    assert "== stage 1 on device 1: cpu" in out and "def forward(self" in out
    assert "looks clean" not in out


def test_inspect_refuses_what_load_refuses_and_shows_it_with_trusted_functions(checkpoint: Path, tmp_path: Path,
                                                                             capsys: pytest.CaptureFixture):
    calling = crafted(checkpoint, tmp_path, "stage_0.json",
                      with_node({"target": {"function": ["tests.models.gpt", "lm_loss"]}, "args": ["X", "X"]}))
    with pytest.raises(CheckpointError, match=r"node 'payload': it calls tests\.models\.gpt\.lm_loss"):
        sw.load(calling)
    assert main(["inspect", str(calling), "--show", "code"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "node 'payload': it calls tests.models.gpt.lm_loss" in line and "--trusted module:function" in line
    assert main(["inspect", str(calling), "--show", "code", "--trusted", "tests.models.gpt:lm_loss"]) == 0
    assert "lm_loss(idx, idx)" in capsys.readouterr().out


def test_inspect_names_a_damaged_file(checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture):
    damaged = copied(checkpoint, tmp_path)
    (damaged / "programs.txt").write_text("truncated")
    assert main(["inspect", str(damaged), "--show", "programs"]) == 2
    assert "programs.txt is truncated" in capsys.readouterr().err


PROCESS_ERRORS = {  # run as a user runs it: a fresh process that prints one line and no traceback
    "unknown-device": (["plan", "tests.cli_factories:hf_gpt2", "--devices", "4xH999"],
                       "'H999' is neither an accelerator nor an instance type of the catalogue; accelerators: "),
}
ERRORS = {  # the same path in this process (no torch import per case)
    "bad-model-spec": (["plan", "no-such-spec", "--devices", "4xH100"],
                       "is neither a file nor module:factory; give a Hugging Face config.json"),
    "missing-config": (["plan", "missing/config.json", "--devices", "4xH100"],
                       "missing/config.json does not exist; give"),
    "no-such-factory": (["plan", "tests.cli_factories:nothing", "--devices", "4xH100"],
                        "has no function 'nothing'; it has"),
    "failing-factory": (["plan", "tests.cli_factories:broken", "--devices", "4xH100"],
                        "the factory raised RuntimeError: this factory fails on purpose; fix it"),
    "not-a-model": (["plan", "tests.cli_factories:not_a_model", "--devices", "4xH100"],
                    "the factory returned an object of type tuple; return the model (a torch.nn.Module), (model, "),
    "bad-batch": (["plan", "tests.cli_factories:hf_gpt2", "--devices", "4xH100", "--batch", "0"],
                  "argument --batch: '0' must be at least 1; see stagewise plan --help"),
    "missing-checkpoint": (["inspect", "no/such/ckpt"],
                           "no/such/ckpt does not exist; give the folder pipe.save() wrote"),
    "unwritable-trace": (["plan", "tests.cli_factories:tiny_gpt", "--devices", "4xH100", "--trace", "no/dir/t.json"],
                         "cannot write no/dir/t.json: there is no folder no/dir; create it first"),
    "precision-without-figure": (["plan", "tests.cli_factories:tiny_gpt", "--devices", "g5.xlarge"],
                                 "the catalogue has no fp32 peak FLOP/s for A10G-24GB"),
}


@pytest.mark.parametrize("case", PROCESS_ERRORS)
def test_a_user_error_is_one_line_naming_the_problem_and_the_fix(case: str):
    args, says = PROCESS_ERRORS[case]
    run = stagewise(*args)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "Traceback" not in run.stderr
    (line,) = run.stderr.strip().splitlines()
    assert line.startswith(f"stagewise {args[0]}: error: ") and says in line


@pytest.mark.parametrize("case", ERRORS)
def test_every_user_error_is_one_line_and_exit_status_2(case: str, capsys: pytest.CaptureFixture):
    args, says = ERRORS[case]
    try:
        status = main(args)
    except SystemExit as exit_:  # argparse's usage errors exit from inside parse_args
        status = exit_.code
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and line.startswith(f"stagewise {args[0]}: error: ") and says in line


def test_debug_shows_the_traceback():
    with pytest.raises(CommandLineError, match="model 'no-such-spec' is neither a file nor module:factory"):
        main(["plan", "no-such-spec", "--devices", "4xH100", "--debug"])
