"""The CUDA paths: five CUDA streams per device ordered by CUDA events, pinned-memory swaps, recycled
transfer buffers, CUDA graphs, compiled stages. Skipped where no GPU is present (the CPU paths are tested
elsewhere)."""

import copy

import pytest
import torch
from torch._dynamo.utils import counters

import stagewise as sw
from tests.harness.cuda import check_on_gpu, gpus
from tests.hf import gpt2, lm_batches
from tests.models.gpt import TinyGPT, lm_loss
from tests.reference import ADAMW, ATOL, RTOL, SGD, pipeline_train, token_batches

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "harmony-pp"])
@pytest.mark.parametrize("swap", ["off", "on"])
def test_schedules_on_cuda_streams_train_like_eager(schedule, swap):
    if schedule == "interleaved" and swap == "on":
        pytest.skip("interleaved does not swap")
    pipe = check_on_gpu(TinyGPT(layers=4), token_batches(), gpus(2), microbatches=4, schedule=schedule, swap=swap)
    assert all(w.device.type == "cuda" for w in pipe._workers)
    assert (sum(s["swap_in_bytes"] for s in pipe.stats) > 0) == (swap == "on")


def test_hf_gpt2_on_cuda_with_clipping_and_swapping():
    check_on_gpu(gpt2(layers=4), lm_batches(), gpus(2), loss_fn=None, microbatches=2, schedule="1f1b", swap="on",
                 clip_grad_norm=0.5)


def test_stream_work_overlaps_on_the_gpu():
    """Swap-ins are issued on their own CUDA stream: the executor gives every device five streams."""
    pipe = sw.compile(TinyGPT(layers=4), gpus(2), token_batches()[0][0], loss_fn=lm_loss,
                      example_target=token_batches()[0][1], microbatches=4, schedule="harmony-pp", swap="on")
    streams = pipe._executor.state.streams[0].streams
    assert len({s.cuda_stream for s in streams.values()}) == 5
    assert torch.cuda.default_stream().cuda_stream not in {s.cuda_stream for s in streams.values()}


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_on_cuda_trains_as_eager_autocast(precision):
    """Stage forwards under CUDA autocast (bf16 / fp16), fp32 masters, against eager torch.autocast on
    the GPU over the same microbatches (tolerances of tests/test_precision.py)."""
    from tests.harness.precision import LOSS_RTOL, PARAM_ATOL, SGD, eager_autocast_train

    torch.manual_seed(0)
    model = TinyGPT(layers=4)
    reference = copy.deepcopy(model).cuda()
    batches = token_batches()
    inputs, target = batches[0]
    pipe = sw.compile(model, gpus(2), inputs, loss_fn=lm_loss, example_target=target, optimizer=SGD, microbatches=2,
                      schedule="1f1b", swap="on", precision=precision)
    got = [float(loss) for loss in pipeline_train(pipe, batches)]
    want = eager_autocast_train(reference, batches, precision, 2, lm_loss, device="cuda")
    assert got == pytest.approx(want, rel=LOSS_RTOL)
    state = reference.state_dict()
    for name, tensor in pipe.state_dict().items():
        assert tensor.dtype == torch.float32
        torch.testing.assert_close(tensor.cpu(), state[name].cpu(), rtol=0, atol=PARAM_ATOL)


def test_any_batch_shape_on_cuda_with_pinned_swaps():
    """Sequence lengths vary per step and the last batch is uneven: the shapes of a step are derived
    on fake CUDA tensors from the swapped (pinned host) stages, as on the CPU (tests/test_any_shape.py).
    Batches come from host memory or the GPU."""
    from tests.harness.any_shape import eager_split_train, train_steps, varied_lm_batches

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    model = gpt2(2)
    reference = copy.deepcopy(model)
    batches = varied_lm_batches()
    pipe = sw.compile(model, gpus(2), batches[0][0], microbatches=2, schedule="1f1b", swap="on", optimizer=ADAMW,
                      cost="analytic")
    gpu_batches = [({k: v.cuda() if step % 2 else v for k, v in inputs.items()}, None)  # from the CPU or the GPU
                   for step, (inputs, _) in enumerate(batches)]
    got = torch.stack([loss.cpu() for loss in train_steps(pipe, gpu_batches)])
    want = torch.stack(eager_split_train(reference, batches, microbatches=1, optimizer=ADAMW))
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    state = reference.state_dict()
    for name, tensor in pipe.state_dict().items():
        torch.testing.assert_close(tensor.cpu(), state[name], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("swap", ["off", "on"])
def test_a_gpu_checkpoint_restores_on_the_cpu_and_loads_back_on_the_gpu(tmp_path, swap):
    """DCP shards of GPU (and pinned host) tensors: restored into a CPU plan of the same model, loaded
    back on the GPU; the weights equal, and the GPU pipeline trains on as the original does."""
    batches = token_batches()
    inputs, target = batches[0]
    torch.manual_seed(0)
    pipe = sw.compile(TinyGPT(layers=4), gpus(2), inputs, loss_fn=lm_loss, example_target=target, optimizer=ADAMW,
                      microbatches=4, schedule="harmony-pp", swap=swap, cost="analytic")
    pipeline_train(pipe, batches[:2])
    pipe.save(tmp_path / "ck")
    want = {k: v.cpu() for k, v in pipe.state_dict().items()}
    torch.manual_seed(1)
    on_cpu = sw.compile(TinyGPT(layers=4), ["cpu", "cpu"], inputs, loss_fn=lm_loss, example_target=target,
                        optimizer=ADAMW, microbatches=4, cost="analytic")
    on_cpu.restore(tmp_path / "ck", report=False)
    for name, tensor in on_cpu.state_dict().items():
        assert torch.equal(tensor, want[name]), name
    loaded = sw.load(tmp_path / "ck", trusted_functions=[lm_loss])
    assert all(w.device.type == "cuda" for w in loaded._workers)
    more = batches[2:]
    torch.testing.assert_close(torch.stack([x.cpu() for x in pipeline_train(loaded, more)]),
                               torch.stack([x.cpu() for x in pipeline_train(pipe, more)]), rtol=0, atol=0)



def _compiled(batches: list, graphs: bool, precision: str = "fp32", **options: object) -> sw.Pipeline:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    inputs, target = batches[0]
    return sw.compile(TinyGPT(layers=4), gpus(2), inputs, loss_fn=lm_loss, example_target=target, optimizer=ADAMW,
                      microbatches=4, schedule="1f1b", swap="off", cost="analytic", precision=precision,
                      cuda_graphs=graphs, **options)


def _losses(pipe: sw.Pipeline, batches: list) -> torch.Tensor:
    return torch.stack([loss.cpu() for loss in pipeline_train(pipe, batches)])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cuda_graphs_replay_the_eager_pipelines_kernels(precision):
    """cuda_graphs=True replays each stage's captured forward and backward, one pair per microbatch (the
    first step of a shape runs eagerly, the next step's start captures it): losses, weights and an
    evaluation after training bitwise those of the pipeline without graphs."""
    batches = token_batches(steps=4)
    graphed, plain = _compiled(batches, True, precision), _compiled(batches, False, precision)
    torch.testing.assert_close(_losses(graphed, batches), _losses(plain, batches), rtol=0, atol=0)
    assert all(len(w.call.graphs) == 4 for w in graphed._workers)  # a graph per microbatch in flight
    state = plain.state_dict()
    for name, tensor in graphed.state_dict().items():
        assert torch.equal(tensor, state[name]), name
    inputs, target = batches[0]
    assert torch.equal(graphed.evaluate(*inputs, target=target), plain.evaluate(*inputs, target=target))


def test_cuda_graphs_train_like_eager():
    """Against eager training on the GPU over the same microbatches, within test_cuda's tolerance."""
    pipe = check_on_gpu(TinyGPT(layers=4), token_batches(steps=4), gpus(2), microbatches=4, schedule="gpipe",
                        swap="off", cost="analytic", cuda_graphs=True)
    assert all(w.call.graphs for w in pipe._workers)


def test_cuda_graphs_capture_each_bucket_once_and_refuse_new_shapes_without_buckets():
    """With shape_buckets every bucket is a shape of its own (captured once, then replayed); without,
    a microbatch keeps the shape it was captured at, and a step of another is refused."""
    lengths = [8, 6, 3, 7, 4, 8]
    batches = [((ids[:, :length],), ids[:, 1:length + 1]) for length, ids in
               zip(lengths, (torch.randint(0, 64, (8, 9)) for _ in lengths), strict=True)]
    graphed, plain = _compiled(batches, True, shape_buckets=4), _compiled(batches, False, shape_buckets=4)
    torch.testing.assert_close(_losses(graphed, batches), _losses(plain, batches), rtol=0, atol=0)
    assert all(len(w.call.graphs) == 8 for w in graphed._workers)  # 4 microbatches x buckets 4 and 8
    fixed = _compiled(batches, True)
    _losses(fixed, batches[:1] * 2)
    with pytest.raises(sw.OptionError, match="shape_buckets"):
        _losses(fixed, batches[1:2])


def test_compiled_stages_on_cuda_train_as_the_pipeline_without():
    """compile_stages=True on the GPU (inductor's Triton kernels): not bitwise, within 1e-4 of the pipeline
    without it over 3 SGD steps (fp32, TF32 off), and no recompile after the first step."""
    torch.backends.cuda.matmul.allow_tf32 = False
    batches = token_batches()
    inputs, target = batches[0]
    pipes, graphs = [], []
    for compiled in (True, False):
        torch.manual_seed(0)
        pipes.append(sw.compile(TinyGPT(layers=2), gpus(2), inputs, loss_fn=lm_loss, example_target=target,
                                optimizer=SGD, microbatches=2, schedule="1f1b", cost="analytic",
                                compile_stages=compiled))
    got = []
    for batch in batches:
        got.append(pipeline_train(pipes[0], [batch])[0].cpu())
        graphs.append(counters["stats"]["unique_graphs"])
    torch.testing.assert_close(torch.stack(got), _losses(pipes[1], batches), rtol=1e-4, atol=1e-5)
    state = pipes[1].state_dict()
    for name, tensor in pipes[0].state_dict().items():
        torch.testing.assert_close(tensor, state[name], rtol=1e-4, atol=1e-5)
    assert graphs[0] == graphs[-1]
