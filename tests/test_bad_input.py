"""Bad compile arguments and step inputs: each gets a StagewiseError subclass naming the problem
and the fix, at compile where it can be known then (issue 10, item 8). tests/test_errors.py has
the cases that came first (devices, traces, partitions); checkpoint files are tested with saves."""

import functools
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stagewise as sw
from tests.hf import gpt2
from tests.models.mlp import mlp

X, Y = torch.randn(8, 8), torch.randint(0, 5, (8,))


def compile_mlp(devices=2, model=None, example_inputs=(X,), **kwargs):
    kwargs.setdefault("loss_fn", F.cross_entropy)
    if kwargs["loss_fn"] is not None:
        kwargs.setdefault("example_target", Y)
    kwargs.setdefault("cost", "analytic")
    return sw.compile(model if model is not None else mlp(), devices, example_inputs, **kwargs)


class _Detached(nn.Module):
    """Returns its loss detached from the parameters."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 5)

    def forward(self, x, y):
        return F.cross_entropy(self.b(self.a(x)), y).detach()


COMPILE_CASES = {
    # clipping: a negative norm makes the loss climb, NaN makes every weight NaN
    "clip-negative": (dict(clip_grad_norm=-1.0), sw.OptionError, "clip_grad_norm=-1.0 must be a positive finite"),
    "clip-zero": (dict(clip_grad_norm=0), sw.OptionError, "clip_grad_norm=0 must be a positive"),
    "clip-nan": (dict(clip_grad_norm=float("nan")), sw.OptionError, "clip_grad_norm=nan"),
    "clip-inf": (dict(clip_grad_norm=float("inf")), sw.OptionError, "clip_grad_norm=inf"),
    "clip-string": (dict(clip_grad_norm="1.0"), sw.OptionError, "e.g. clip_grad_norm=1.0"),
    "clip-bool": (dict(clip_grad_norm=True), sw.OptionError, "clip_grad_norm=True"),
    # the optimizer: a factory that makes an optimizer (a lambda is fine: checkpoints record the class)
    "optimizer-instance": (dict(optimizer=torch.optim.SGD(mlp().parameters(), lr=0.1)), sw.OptionError,
                           "SGD instance.*functools.partial"),
    "optimizer-not-callable": (dict(optimizer="adam"), sw.OptionError, "optimizer='adam' is not callable"),
    "optimizer-returns-other": (dict(optimizer=functools.partial(list)), sw.OptionError,
                                "returned a list, not a torch.optim.Optimizer"),
    "optimizer-bad-arguments": (dict(optimizer=functools.partial(torch.optim.SGD, lr=-1.0)), sw.OptionError,
                                "fails when called with a list of parameters"),
    "optimizer-zero": (dict(optimizer=0), sw.OptionError, "optimizer=0 is not callable"),
    # loss and target
    "loss-without-target": (dict(example_target=None), sw.LossError, "without example_target"),
    "target-without-loss": (dict(loss_fn=None, example_target=Y), sw.LossError, "example_target is given without loss_fn"),
    "loss-not-callable": (dict(loss_fn="cross_entropy"), sw.LossError, "is not callable"),
    "target-not-tensor": (dict(example_target=[1, 2]), sw.ExampleInputsError, "example_target is a list"),
    "loss-fn-detached": (dict(loss_fn=lambda out, y: F.cross_entropy(out, y).detach()), sw.LossError,
                         "does not depend on any trainable parameter"),
    "loss-fn-detached-output": (dict(loss_fn=lambda out, y: F.cross_entropy(out.detach(), y)), sw.LossError,
                                "drop .detach()"),
    "loss-reduction-string": (dict(loss_reduction="mean"), sw.LossError, "is not a reduction stagewise knows"),
    "loss-reduction-labels-with-loss-fn": (dict(loss_reduction=sw.TokenMean(labels="x")), sw.LossError,
                                           "counts come from the target; drop labels="),
    "token-mean-float-ignore": (dict(loss_reduction=sw.TokenMean(ignore_index=-100.0)), sw.LossError,
                                "must be an int"),
    # counts, names and flags
    "microbatches-zero": (dict(microbatches=0), sw.BatchSizeError, "microbatches must be a positive int, got 0"),
    "microbatches-float": (dict(microbatches=2.0), sw.BatchSizeError, "got 2.0"),
    "microbatches-bool": (dict(microbatches=True), sw.BatchSizeError, "got True"),
    "swap-unknown": (dict(swap="sometimes"), sw.OptionError, "unknown swap='sometimes'; choose one of"),
    "swap-bool": (dict(swap=True), sw.OptionError, "unknown swap=True"),
    "cost-unknown": (dict(cost="guess"), sw.PlanError, "unknown cost='guess'"),
    "schedule-list": (dict(schedule=["gpipe"]), sw.PlanError, r"unknown schedule \['gpipe'\]"),
    "stages-bool": (dict(stages=True), sw.PlanError, "stages must be a positive int"),
    "stages-zero": (dict(stages=0), sw.PlanError, "stages must be a positive int"),
    "replicas-zero": (dict(replicas=0), sw.PlanError, "replicas must be a positive int"),
    "host-optimizer-string": (dict(optimizer_on_host="yes"), sw.OptionError, "must be True or False"),
    "split-points-string": (dict(split_points="4"), sw.OptionError, r"split_points=\['4'\]"),
    "split-points-int": (dict(split_points=4), sw.OptionError, "must be a list of layer names"),
    "split-points-of-ints": (dict(split_points=[4]), sw.OptionError, "by their module names"),
}


@pytest.mark.parametrize(("kwargs", "error", "phrase"), COMPILE_CASES.values(), ids=COMPILE_CASES.keys())
def test_bad_compile_argument(kwargs, error, phrase):
    with pytest.raises(error, match=phrase):
        compile_mlp(**kwargs)


DEVICE_CASES = {
    "memory-zero": (dict(memory=0), "memory=0 leaves no bytes"),
    "memory-negative": (dict(memory=-5), "give a positive size"),
    "memory-zero-string": (dict(memory="0GiB"), "leaves no bytes"),
    "memory-bool": (dict(memory=True), "memory=True is a bool"),
    "memory-list": (dict(memory=[1]), "is a list"),
    "speed-zero": (dict(speed=0), "speed=0 must be a positive finite"),
    "speed-nan": (dict(speed=float("nan")), "speed=nan"),
    "speed-string": (dict(speed="fast"), "speed='fast' is a str"),
    "peak-flops-inf": (dict(peak_flops=float("inf")), "peak_flops=inf must be a positive finite"),
    "peak-flops-negative": (dict(peak_flops=-1), "peak_flops=-1 must be"),
    "bandwidth-nan": (dict(memory_bandwidth=float("nan")), "memory_bandwidth=nan"),
    "host-bandwidth-bool": (dict(host_bandwidth=True), "host_bandwidth=True is a bool"),
    "name-int-list": (dict(name=["cpu"]), "is a list; give 'cpu'"),
    "host-memory-zero": (dict(host_memory=0), "host_memory=0 leaves no bytes"),
    "host-memory-word": (dict(host_memory="lots"), "cannot read host_memory size 'lots'; write it like 512MiB"),
    "host-memory-bool": (dict(host_memory=True), "host_memory=True is a bool"),
    "host-memory-overflowing": (dict(host_memory="1e400GiB"), "host_memory='1e400GiB' is no finite size"),
    "host-negative": (dict(host=-1), r"host=-1: give the index of the device's host, a whole number from 0"),
    "host-bool": (dict(host=True), "host=True: give the index"),
    "host-string": (dict(host="node0"), "host='node0': give the index"),
}


@pytest.mark.parametrize(("kwargs", "phrase"), DEVICE_CASES.values(), ids=DEVICE_CASES.keys())
def test_bad_device_figure(kwargs, phrase):
    with pytest.raises(sw.DeviceError, match=phrase):
        sw.Device(**kwargs)


def test_memory_too_small_for_a_layer_is_refused_at_compile():
    """An explicit plan is not searched; a device that cannot hold one layer's weights fails now."""
    with pytest.raises(sw.CapacityError, match="cannot hold layer .* its weights alone take"):
        compile_mlp([sw.Device("cpu", memory=64)] * 2, schedule="gpipe", microbatches=2)


MODEL_CASES = {
    "model-on-meta": (dict(model=mlp().to("meta")), sw.ExampleInputsError, "meta device.*to_empty"),
    "inputs-on-meta": (dict(example_inputs=(X.to("meta"),)), sw.ExampleInputsError, "'input' is on the meta device"),
    "batch-of-zero": (dict(example_inputs=(X[:0],), example_target=Y[:0]), sw.BatchSizeError, "batch of 0 samples"),
    "target-batch-differs": (dict(example_target=Y[:6]), sw.ExampleInputsError, r"disagree on the batch size.*\[6, 8\]"),
    "model-returns-detached-loss": (dict(model=_Detached(), example_inputs=(X, Y), loss_fn=None), sw.LossError,
                                    "does not depend on any trainable parameter"),
}


@pytest.mark.parametrize(("kwargs", "error", "phrase"), MODEL_CASES.values(), ids=MODEL_CASES.keys())
def test_bad_model_or_example(kwargs, error, phrase):
    with pytest.raises(error, match=phrase):
        compile_mlp(**kwargs)


@pytest.fixture(scope="module")
def pipe():
    return compile_mlp(microbatches=2, schedule="gpipe")


STEP_CASES = {
    "target-batch-differs": ((X,), dict(target=Y[:6]), sw.BatchSizeError, "batch of 6 for 'target'.*batches of 8"),
    "target-0d": ((X,), dict(target=Y[0]), sw.BatchSizeError, "0-d tensor for 'target'"),
    "target-not-tensor": ((X,), dict(target=Y.tolist()), sw.ExampleInputsError, "step got a list for 'target'"),
    "target-dtype": ((X,), dict(target=Y.float()), sw.ExampleInputsError, "'target' of dtype torch.float32.*torch.int64"),
    "target-extra-dim": ((X,), dict(target=Y[:, None]), sw.ExampleInputsError, r"'target' with sizes .* \[1\] .* \[\]"),
    "input-other-width": ((torch.randn(8, 9),), dict(target=Y), sw.ExampleInputsError,
                          r"sizes after the batch dimension \[9\] but the example had \[8\]"),
    "input-dtype": ((X.double(),), dict(target=Y), sw.ExampleInputsError, r"convert it with .to\(torch.float32\)"),
    "input-on-meta": ((X.to("meta"),), dict(target=Y), sw.ExampleInputsError, "on the meta device"),
    "input-not-tensor": ((X.tolist(),), dict(target=Y), sw.ExampleInputsError, "'input' is a list"),
    "input-0d": ((torch.tensor(1.0),), dict(target=Y), sw.BatchSizeError, "0-d tensor for 'input'"),
    "too-many-inputs": ((X, X), dict(target=Y), sw.ExampleInputsError, "1 positional inputs"),
}


@pytest.mark.parametrize(("args", "kwargs", "error", "phrase"), STEP_CASES.values(), ids=STEP_CASES.keys())
def test_bad_step_input(pipe, args, kwargs, error, phrase):
    with pytest.raises(error, match=phrase):
        pipe.step(*args, **kwargs)


def test_bad_step_inputs_leave_the_pipeline_usable(pipe):
    """Every check runs before any stage is given a tensor: a good step follows a refused one."""
    with pytest.raises(sw.ExampleInputsError):
        pipe.step(X.double(), target=Y)
    assert torch.isfinite(pipe.step(X, target=Y))


def test_target_given_to_a_pipeline_without_loss_fn():
    model = _Ok()
    pipe = sw.compile(model, 2, (X, Y), cost="analytic", microbatches=2, schedule="gpipe")
    with pytest.raises(sw.ExampleInputsError, match="compiled without loss_fn.*drop target="):
        pipe.step(X, Y, target=Y)


class _Ok(nn.Module):
    """Returns its own loss."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 5)

    def forward(self, x, y):
        return F.cross_entropy(self.b(self.a(x)), y)


def test_option_errors_are_plan_errors():
    """OptionError came after the PlanErrors raised for unknown schedules: code catching those keeps working."""
    assert issubclass(sw.OptionError, sw.PlanError) and issubclass(sw.OptionError, sw.StagewiseError)


# ---- the last raw errors (issue 21, item 8) ---------------------------------------------------


class _Tokens(nn.Module):
    """Token ids straight into an nn.Embedding leaf (fx keeps it a call_module)."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(10, 4), nn.Linear(4, 5)

    def forward(self, ids):
        return self.head(self.embed(ids).mean(1))


def _token_pipe(kind: str):
    """A pipeline whose input feeds an embedding of 10 rows (fx leaf) or 128 (GPT-2: export, through a view)."""
    torch.manual_seed(0)
    if kind == "fx-leaf":
        ids = torch.randint(0, 10, (8, 3))
        pipe = sw.compile(_Tokens(), 2, (ids,), loss_fn=F.cross_entropy, example_target=Y, microbatches=2,
                          cost="analytic")
        return pipe, 10, lambda call, x: call(x, target=Y), ids
    ids = torch.randint(1, 100, (8, 6))
    pipe = sw.compile(gpt2(2), 2, {"input_ids": ids, "labels": ids}, microbatches=2, cost="analytic")
    return pipe, 128, lambda call, x: call(input_ids=x, labels=ids), ids


@pytest.mark.parametrize("kind", ["fx-leaf", "hf-gpt2"])
def test_token_ids_outside_the_embedding_are_named_before_anything_runs(kind):
    pipe, rows, call, ids = _token_pipe(kind)
    name = "ids" if kind == "fx-leaf" else "input_ids"
    before = {k: v.clone() for k, v in pipe.state_dict().items()}
    for bad_id in (rows, -1):
        bad = ids.clone()
        bad[5, 1] = bad_id
        for method in (pipe.step, pipe.evaluate):
            with pytest.raises(sw.ExampleInputsError, match=f"{method.__name__} got '{name}' holding the id {bad_id}, "
                                                            f"but it indexes an embedding of {rows} rows"):
                call(method, bad)
        with pytest.raises(sw.ExampleInputsError, match=f"predict got '{name}' holding the id {bad_id}"):
            pipe.predict(bad) if kind == "fx-leaf" else pipe.predict(input_ids=bad)
    assert pipe._executor.state.iteration == 0
    for key, value in pipe.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert torch.isfinite(call(pipe.step, ids))


def test_save_refuses_paths_that_name_no_folder_of_its_own(pipe, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for directory in (".", "..", tmp_path, "/"):
        with pytest.raises(sw.CheckpointError, match="holds the current directory.*a folder of its own"):
            pipe.save(directory)
    with pytest.raises(sw.CheckpointError, match=r"pipe.save\(''\) names no directory"):
        pipe.save("")
    with pytest.raises(sw.CheckpointError, match="pipe.save takes the checkpoint's directory as a str or pathlib.Path"):
        pipe.save(None)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("directory", [None, 123])
def test_load_names_a_directory_that_is_not_a_path(directory):
    with pytest.raises(sw.CheckpointError, match=f"sw.load takes the checkpoint's directory .*got {type(directory).__name__}"):
        sw.load(directory)


def test_load_of_no_directory_or_a_nameless_one(pipe, tmp_path, monkeypatch):
    with pytest.raises(sw.CheckpointError, match=r"sw.load\(''\) names no directory"):
        sw.load("")  # was a ValueError from pathlib
    pipe.save(tmp_path / "ck")
    monkeypatch.chdir(tmp_path / "ck")
    loaded = sw.load(".")  # the current directory is the checkpoint: '.' has no name of its own
    assert all(torch.equal(v, pipe.state_dict()[k]) for k, v in loaded.state_dict().items())
    monkeypatch.chdir(tmp_path / "ck" / "weights")
    assert sw.load("..").plan == pipe.plan
    monkeypatch.chdir(tmp_path)
    with pytest.raises(sw.CheckpointError, match="holds no stagewise checkpoint"):
        sw.load(".")


@pytest.mark.parametrize("given", ["plan.json", None])
def test_simulate_takes_a_plan(given):
    with pytest.raises(sw.OptionError, match=f"sw.simulate takes a Plan .*got {type(given).__name__}"):
        sw.simulate(given)  # was an AttributeError


@pytest.mark.parametrize("text", ['{"model": 1}', "not json", "[]", '{"programs": 3}'])
def test_plan_from_json_of_something_else(text):
    with pytest.raises(sw.CheckpointError, match="this is not a plan stagewise wrote"):
        sw.Plan.from_json(text)  # were TypeError, JSONDecodeError, AttributeError


TRUSTED_CASES = {
    "one-function": (F.cross_entropy, r"alone: write trusted_functions=\[fn\]"),
    "a-string": ("my_loss", "takes a list of functions .*got str"),
    "names": (["my_loss"], "holds 'my_loss', a str, not a function"),
}


@pytest.mark.parametrize(("trusted", "phrase"), TRUSTED_CASES.values(), ids=TRUSTED_CASES.keys())
def test_trusted_functions_of_the_wrong_type(trusted, phrase, tmp_path):
    with pytest.raises(sw.OptionError, match=phrase):
        sw.load(tmp_path / "ck", trusted_functions=trusted)


def test_checkpoints_over_a_file(tmp_path):
    file = tmp_path / "notes.txt"
    file.write_text("mine")
    for directory in (file, file / "run"):
        with pytest.raises(sw.CheckpointError, match="notes.txt is a file, not a folder"):
            sw.Checkpoints(directory, every_steps=1)
    assert file.read_text() == "mine"
    with pytest.raises(sw.CheckpointError, match="sw.Checkpoints takes the checkpoint's directory as a str"):
        sw.Checkpoints(None, every_steps=1)
    assert sw.Checkpoints(".", every_steps=1).directory == Path(".")  # it holds step_<n> folders: '.' will do


@pytest.mark.parametrize(("candidates", "phrase"), [("1xH100", r"the string '1xH100' alone .*candidates=\['1xH100'\]"),
                                                    ([], r"candidates=\[\] gives no device set")])
def test_recommend_candidates_not_a_list_of_requests(candidates, phrase):
    with pytest.raises(sw.OptionError, match=phrase):
        sw.recommend(mlp(), (X,), loss_fn=F.cross_entropy, example_target=Y, candidates=candidates)


def test_more_devices_than_the_plan_warn_that_some_stay_idle(pipe, tmp_path):
    pipe.save(tmp_path / "ck")
    with pytest.warns(sw.IdleDevicesWarning, match=r"load.*2 devices, so 1 of the 3 given stay idle.*replan=True"):
        loaded = sw.load(tmp_path / "ck", devices=3, replan=False)
    with pytest.warns(sw.IdleDevicesWarning, match=r"pipe.resize: the plan has 2 devices, so 2 of the 4 given") as told:
        loaded.resize(4)
    assert len(told) == 1
    assert torch.isfinite(loaded.step(X, target=Y))


def test_a_plan_asked_for_that_does_not_fit_warns_before_its_first_step():
    """Schedule, microbatches and split given: nothing is searched, so the plan is kept as asked, but
    its predicted peak (about 180 KB a device) is far over 20 kB: said at plan time, naming the device
    and what would fit instead. The same plan on devices that hold it is not warned about."""
    x, y = torch.randn(256, 8), torch.randint(0, 5, (256,))
    asked = {"microbatches": 8, "schedule": "1f1b", "split_points": ["8"], "swap": "off"}

    def planned(memory: int) -> sw.Plan:
        device = sw.Device("cuda", memory=memory, peak_flops="1TFLOPS", memory_bandwidth="1TB/s")
        return sw.plan(mlp(width=64, depth=8), [device, device], (x,), loss_fn=F.cross_entropy, example_target=y,
                       **asked)

    with pytest.warns(sw.DoesNotFitWarning, match=r"does not fit: device 0 would need [\d.]+ KiB of its 19.5 KiB.*"
                                                   r"CapacityError.*schedule='auto'"):
        plan = planned(20_000)
    assert max(plan.predicted_peak_bytes) > 20_000
    with warnings.catch_warnings():
        warnings.simplefilter("error", sw.DoesNotFitWarning)
        planned(2**30)


def test_plan_for_a_gpu_without_peak_flops_warns():
    gpus = [sw.Device("cuda", memory="80GiB")] * 2
    with pytest.warns(sw.AssumedFiguresWarning, match="cuda has no peak_flops.*peak_flops='989TFLOPS'"):
        sw.plan(mlp(), gpus, (X,), loss_fn=F.cross_entropy, example_target=Y)
    rated = [sw.Device("cuda", memory="80GiB", peak_flops="989TFLOPS")] * 2
    with warnings.catch_warnings():
        warnings.simplefilter("error", sw.AssumedFiguresWarning)
        sw.plan(mlp(), rated, (X,), loss_fn=F.cross_entropy, example_target=Y)


def test_save_and_load_in_one_process_print_no_distributed_notice(pipe, tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe.save(tmp_path / "ck")
        sw.load(tmp_path / "ck")
    assert not [w for w in caught if "torch.distributed is disabled" in str(w.message)]
