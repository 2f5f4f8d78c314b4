"""A saved pipeline loads without the model class or re-tracing, and trains on identically."""

import subprocess
import sys

import pytest
import torch

import stagewise as sw
from stagewise.passes.sim_split import time_split
from tests.harness.checkpoints import assert_optimizer_state_equal, optimizer_state
from tests.hf import gpt2, lm_batches
from tests.models.cnn import ResNet
from tests.models.gpt import TinyGPT, lm_loss
from tests.reference import ADAMW, assert_state_equal, pipeline_train, token_batches


@pytest.mark.parametrize("stages", [None, 2], ids=["every-device", "idle-device"])
def test_save_load_trains_on_identically(tmp_path, stages):
    ids = torch.randint(0, 64, (8, 9))
    batches = [((ids[:, :-1],), ids[:, 1:])] * 2
    pipe = sw.compile(TinyGPT(), 3, batches[0][0], loss_fn=lm_loss, example_target=batches[0][1],
                      optimizer=ADAMW, microbatches=2, clip_grad_norm=0.5, stages=stages)
    pipeline_train(pipe, batches)
    pipe.save(tmp_path / "ck")
    loaded = sw.load(tmp_path / "ck")
    assert_state_equal(loaded.state_dict(), pipe.state_dict())
    assert_optimizer_state_equal(optimizer_state(loaded), optimizer_state(pipe), exact=True)
    more = [((torch.randint(0, 64, (8, 8)),), torch.randint(0, 64, (8, 8))) for _ in range(2)]
    torch.testing.assert_close(torch.stack(pipeline_train(loaded, more)), torch.stack(pipeline_train(pipe, more)),
                               rtol=0, atol=0)
    assert_state_equal(loaded.state_dict(), pipe.state_dict())
    assert loaded.plan.to_json() == pipe.plan.to_json()


def test_save_load_of_a_swapping_pipeline_holds_the_swapped_state(tmp_path):
    """Swapped stages keep weights and optimizer state in host memory between steps: the checkpoint
    holds those values (not the empty device placeholders), and the loaded pipeline swaps alike."""
    batches = token_batches(2)
    pipe = sw.compile(TinyGPT(), 2, batches[0][0], loss_fn=lm_loss, example_target=batches[0][1], optimizer=ADAMW,
                      microbatches=2, schedule="harmony-pp", swap="on", cost="analytic")
    pipeline_train(pipe, batches)
    assert any(w.swapped for w in pipe._workers)
    pipe.save(tmp_path / "ck")
    loaded = sw.load(tmp_path / "ck")
    assert [w.swapped for w in loaded._workers] == [w.swapped for w in pipe._workers]
    assert_state_equal(loaded.state_dict(), pipe.state_dict())
    assert_optimizer_state_equal(optimizer_state(loaded), optimizer_state(pipe), exact=True)
    more = token_batches(2)
    torch.testing.assert_close(torch.stack(pipeline_train(loaded, more)), torch.stack(pipeline_train(pipe, more)),
                               rtol=0, atol=0)
    assert loaded.stats[0]["swap_in_bytes"] > 0


def test_save_load_keeps_buffers_shared_across_stages(tmp_path):
    """Harmony DP puts every pack on every device, so TinyGPT's causal-mask buffer is held by several
    stages; the reloaded stages must keep it a named buffer (not an anonymous constant)."""
    batches = token_batches(2)
    pipe = sw.compile(TinyGPT(), 2, batches[0][0], loss_fn=lm_loss, example_target=batches[0][1],
                      microbatches=2, schedule="harmony-dp", cost="analytic")
    assert any(t.kind == "buffer" for t in pipe.plan.shared)
    pipeline_train(pipe, batches)
    pipe.save(tmp_path / "ck")
    loaded = sw.load(tmp_path / "ck")
    more = token_batches(2)
    torch.testing.assert_close(torch.stack(pipeline_train(loaded, more)), torch.stack(pipeline_train(pipe, more)),
                               rtol=0, atol=0)
    assert_state_equal(loaded.state_dict(), pipe.state_dict())


def test_saved_stage_files_are_importable_python(tmp_path):
    batches = lm_batches(1)
    pipe = sw.compile(gpt2(), 2, batches[0][0], microbatches=2)
    pipe.save(tmp_path / "ck")
    files = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert {"plan.json", "programs.txt", "stage_0.py", "stage_1.py", "stage_0.json", "training.pt", "weights"} <= set(files)
    source = (tmp_path / "ck" / "stage_1.py").read_text()
    assert "class Stage1(torch.nn.Module)" in source and "transformer_h_" in source
    # importable by plain Python in a fresh interpreter, without transformers
    code = (
        "import importlib.util, sys; sys.modules['transformers'] = None;"
        f"s = importlib.util.spec_from_file_location('s', {str(tmp_path / 'ck' / 'stage_1.py')!r});"
        "m = importlib.util.module_from_spec(s); s.loader.exec_module(m); print(m.Stage1.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "Stage1"


def test_load_runs_without_the_model_class(tmp_path):
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))
    pipe = sw.compile(ResNet(), 2, (x,), loss_fn=torch.nn.functional.cross_entropy, example_target=y, microbatches=2)
    pipe.save(tmp_path / "ck")
    torch.save((x, y), tmp_path / "batch.pt")
    code = (
        "import sys, torch; sys.modules['tests'] = None; import stagewise as sw;"
        f"p = sw.load({str(tmp_path / 'ck')!r}); x, y = torch.load({str(tmp_path / 'batch.pt')!r});"
        "print(float(p.step(x, target=y)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert abs(float(out.stdout) - float(pipe.step(x, target=y))) < 1e-6


def test_save_over_an_existing_checkpoint_replaces_it_whole(tmp_path):
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))
    pipe = sw.compile(ResNet(), 2, (x,), loss_fn=torch.nn.functional.cross_entropy, example_target=y)
    pipe.save(tmp_path / "ck")
    pipe.step(x, target=y)
    pipe.save(tmp_path / "ck")
    assert_state_equal(sw.load(tmp_path / "ck").state_dict(), pipe.state_dict())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no staging or backup left behind


def test_load_from_a_directory_without_checkpoint(tmp_path):
    import pytest

    with pytest.raises(sw.PlanError, match="plan.json is missing"):
        sw.load(tmp_path)


def test_state_dict_round_trip_uses_original_names():
    model = TinyGPT()
    ids = torch.randint(0, 64, (4, 8))
    pipe = sw.compile(model, 4, (ids,), loss_fn=lm_loss, example_target=ids)
    assert list(pipe.state_dict()) == list(model.state_dict())
    fresh = TinyGPT()
    pipe.load_state_dict(fresh.state_dict())
    assert_state_equal(pipe.state_dict(), fresh.state_dict())


@pytest.mark.parametrize("schedule", ["1f1b", "auto"])
def test_a_loaded_pipeline_simulates_what_compile_predicted(tmp_path, schedule):
    """The plan keeps the costs its prediction charged (each layer's analytic costs at the plan's
    microbatch size, the measured links, what the runtime adds): `simulate()` charges them again,
    after `sw.load` as before, so it predicts the plan's time exactly."""
    batches = token_batches(1)
    pipe = sw.compile(TinyGPT(), 2, batches[0][0], loss_fn=lm_loss, example_target=batches[0][1],
                      microbatches=None if schedule == "auto" else 2, schedule=schedule, cost="analytic")
    predicted = pipe.plan.predicted_iteration_s
    assert pipe.simulate().iteration_time == predicted
    pipe.save(tmp_path / "ck")
    loaded = sw.load(tmp_path / "ck")
    assert loaded.plan.costs == pipe.plan.costs
    assert loaded.simulate().iteration_time == predicted
    assert loaded.simulate().peak_bytes == pipe.simulate().peak_bytes
    assert time_split(loaded.simulate()) == pipe.plan.predicted_split and str(loaded.plan) == str(pipe.plan)


def test_a_pipeline_saved_in_eval_mode_loads_in_eval_mode(tmp_path):
    """The mode is part of what was saved (as a pickled module keeps it): dropout stays off."""
    from tests.models.dropout import DropoutGPT

    batches = token_batches(2)
    inputs, target = batches[0]
    pipe = sw.compile(DropoutGPT(p=0.5, layers=2), 2, inputs, loss_fn=lm_loss, example_target=target,
                      microbatches=2, cost="analytic")
    pipe.eval()
    pipe.save(tmp_path / "ck")
    loaded = sw.load(tmp_path / "ck")
    assert not loaded.training and all(not w.module.training for w in loaded._workers)
    assert torch.equal(loaded.step(*inputs, target=target), pipe.step(*inputs, target=target))
    loaded.train()
    assert loaded.training
