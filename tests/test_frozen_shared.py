"""Frozen, shared and parameterless (issue 10, item 5): `requires_grad=False` respected on every path,
stages without trainable parameters or without inputs, models without parameters, LoRA fine-tuning.

A frozen parameter has no gradient, no optimizer state and never moves: not through the shared
all-reduce (which would hand it zeros, and AdamW's weight decay would then move it), not on a replica,
a swapped stage, the host optimizer or under clipping. Everything else trains as eager does.
"""

from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import stagewise as sw
from stagewise.ir.instructions import AllReduceShared, Carried, Recv
from stagewise.ir.plan import Layer, Stage
from stagewise.passes.cutpoints import value_info
from stagewise.passes.swap import plan_swaps
from tests.hf import gpt2, llama, lm_batches
from tests.models.gpt import TinyGPT, lm_loss
from tests.reference import ADAMW, assert_state_equal, eager_train, pipeline_train, token_batches

# compile options per path a frozen tied weight must survive: every schedule, replicas, swaps, host
# optimizer and clipping (two stages cut between the embedding and the LM head that share it)
TIED_PATHS = {
    "gpipe": dict(schedule="gpipe"),
    "1f1b": dict(schedule="1f1b"),
    "varuna": dict(schedule="varuna"),
    "interleaved": dict(schedule="interleaved", split_points=["blocks.0", "blocks.1", "ln_f"]),
    "harmony-pp": dict(schedule="harmony-pp"),
    "harmony-dp": dict(schedule="harmony-dp"),
    "swap-on": dict(schedule="1f1b", swap="on"),
    "swap-all": dict(schedule="gpipe", swap="all"),
    "host-optimizer": dict(schedule="1f1b", optimizer_on_host=True),
    "clip": dict(schedule="1f1b", clip_grad_norm=0.05),
    "clip-swap-host": dict(schedule="harmony-pp", swap="on", optimizer_on_host=True, clip_grad_norm=0.05),
    "data-parallel": dict(schedule="gpipe", replicas=2, split_points=None),
    "replicated-stage": dict(schedule="1f1b", replicas=(2, 1), devices=3),
}


def train_beside_eager(model, batches, devices, *, loss_fn=lm_loss, optimizer=ADAMW, **options):
    """Compile and train `model`, and an eager copy on the same microbatches; returns the pipeline,
    its losses and the eager model and losses."""
    reference = copy.deepcopy(model)
    inputs, target = batches[0]
    pipe = sw.compile(model, devices, inputs, loss_fn=loss_fn, example_target=target, optimizer=optimizer,
                      cost="analytic", **options)
    got = pipeline_train(pipe, batches)
    want = eager_train(reference, batches, loss_fn=loss_fn, optimizer=optimizer, microbatches=pipe.plan.microbatches,
                       clip_grad_norm=options.get("clip_grad_norm"))
    return pipe, got, reference, want


def assert_trains_like_eager(pipe, got, reference, want) -> None:
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-5, atol=1e-6)
    assert_state_equal(pipe.state_dict(), reference.state_dict())


def frozen_names(model: nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def assert_frozen_have_no_optimizer_state(pipe) -> None:
    """No worker's optimizer holds a frozen parameter; a stage with nothing to train has none."""
    for worker in pipe._workers:
        trainable = [p for p in worker.module.parameters() if p.requires_grad]
        if not trainable:
            assert worker.optimizer is None
            continue
        held = {id(p) for group in worker.optimizer.param_groups for p in group["params"]}
        assert held == {id(p) for p in trainable}
        assert all(p.requires_grad for p in worker.optimizer.state)


@pytest.mark.parametrize("path", sorted(TIED_PATHS))
def test_frozen_tied_weight_never_moves(path: str) -> None:
    """GPT's embedding, tied to its LM head and frozen, split across stages: bitwise unchanged after
    AdamW with weight decay, no all-reduce of it, no optimizer state; the rest equals eager."""
    torch.manual_seed(0)
    options = dict(TIED_PATHS[path])
    options.setdefault("split_points", ["blocks.1"])
    devices = options.pop("devices", 2)
    model = TinyGPT(layers=2)
    model.tok.weight.requires_grad_(False)
    before = model.tok.weight.detach().clone()
    pipe, got, reference, want = train_beside_eager(model, token_batches(steps=2), devices, microbatches=2, **options)
    state = pipe.state_dict()
    assert torch.equal(state["tok.weight"], before) and torch.equal(state["head.weight"], before)
    assert_trains_like_eager(pipe, got, reference, want)
    tied = [t for t in pipe.plan.shared if "tok.weight" in t.names]
    assert tied and not any(t.summed for t in tied)
    reduced = {name for p in pipe.programs for i in p.instructions if isinstance(i, AllReduceShared) for name in i.tensors}
    assert not reduced & {"tok.weight", "head.weight"}
    assert_frozen_have_no_optimizer_state(pipe)


def test_frozen_parameters_take_no_optimizer_memory() -> None:
    """The device pools hold AdamW's two moments of the trainable parameters only."""
    torch.manual_seed(0)
    model = TinyGPT(layers=2)
    model.tok.weight.requires_grad_(False)
    model.blocks[0].requires_grad_(False)
    pipe, *_ = train_beside_eager(model, token_batches(steps=1), 2, microbatches=2, schedule="1f1b",
                                  split_points=["blocks.1"])
    for worker, stats in zip(pipe._workers, pipe.stats, strict=True):
        trainable = sum(p.numel() * p.element_size() for p in worker.module.parameters() if p.requires_grad)
        assert stats["optimizer_bytes"] == 2 * trainable


def test_frozen_model_saves_and_loads(tmp_path) -> None:
    """The optimizer state (by position over the trainable parameters) fits the loaded stages."""
    torch.manual_seed(0)
    model = TinyGPT(layers=2)
    model.tok.weight.requires_grad_(False)
    batches = token_batches(steps=3)
    pipe, *_ = train_beside_eager(copy.deepcopy(model), batches[:1], 2, microbatches=2, schedule="1f1b",
                                  split_points=["blocks.1"])
    pipe.save(tmp_path / "ckpt")
    loaded = sw.load(tmp_path / "ckpt")
    assert_frozen_have_no_optimizer_state(loaded)
    # the saved pipeline trains on as the uninterrupted twin
    torch.testing.assert_close(torch.stack(pipeline_train(loaded, batches[1:])), torch.stack(pipeline_train(pipe, batches[1:])))
    assert_state_equal(loaded.state_dict(), pipe.state_dict())
    assert torch.equal(loaded.state_dict()["tok.weight"], model.tok.weight)


def frozen_bottom_gpt(layers: int = 4, frozen_blocks: int = 2) -> TinyGPT:
    """The fine-tuning recipe: embeddings and the first blocks frozen, the top trained."""
    model = TinyGPT(layers=layers, tie=False)
    for module in [model.tok, model.pos, *model.blocks[:frozen_blocks]]:
        module.requires_grad_(False)
    return model


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "varuna", "harmony-pp", "harmony-dp"])
def test_stage_without_trainable_parameters(schedule: str) -> None:
    """Stage 0 holds only frozen layers: it has no optimizer, receives no gradient (nothing before it
    trains), and the pipeline equals eager AdamW."""
    torch.manual_seed(0)
    pipe, got, reference, want = train_beside_eager(frozen_bottom_gpt(), token_batches(steps=2), 2, microbatches=2,
                                                    schedule=schedule, split_points=["blocks.2"])
    assert_trains_like_eager(pipe, got, reference, want)
    assert_frozen_have_no_optimizer_state(pipe)
    assert all(w.optimizer is None for w in pipe._workers if w.stage.position == 0)
    grads_in = [i for p in pipe.programs for i in p.instructions
                if isinstance(i, Recv) and i.carries is Carried.GRADIENTS and pipe.plan.stages[i.stage].position == 0]
    assert not grads_in


@pytest.mark.parametrize("options", [dict(schedule="gpipe"), dict(schedule="varuna"),
                                     dict(schedule="1f1b", swap="on", optimizer_on_host=True, clip_grad_norm=0.05)],
                         ids=["gpipe", "varuna", "swap-host-clip"])
def test_frozen_middle_stage_passes_gradients_back(options: dict) -> None:
    """A frozen stage between trained ones runs no update but still sends its input gradients back."""
    torch.manual_seed(0)
    model = TinyGPT(layers=4, tie=False)
    model.blocks[1:3].requires_grad_(False)
    pipe, got, reference, want = train_beside_eager(model, token_batches(steps=2), 3, microbatches=2,
                                                    split_points=["blocks.1", "blocks.3"], **options)
    assert_trains_like_eager(pipe, got, reference, want)
    assert pipe._workers[1].optimizer is None
    assert_frozen_have_no_optimizer_state(pipe)


class Activations(nn.Module):
    """A model without parameters: the loss still depends on the input."""

    def __init__(self):
        super().__init__()
        self.soft = nn.Softplus()
        self.tanh = nn.Tanh()
        self.sign = nn.Softsign()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.sign(self.tanh(self.soft(x)))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "varuna", "harmony-dp"])
def test_model_without_parameters_returns_its_loss(schedule: str) -> None:
    """Nothing to train: every step returns eager's loss and nothing changes (no optimizer anywhere)."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    pipe = sw.compile(Activations(), 2, (x,), loss_fn=F.mse_loss, example_target=y, cost="analytic",
                      schedule=schedule, microbatches=2, split_points=["tanh"], clip_grad_norm=1.0)
    for _ in range(2):
        torch.testing.assert_close(pipe.step(x, target=y), F.mse_loss(Activations()(x), y))
    assert all(w.optimizer is None for w in pipe._workers)


def test_model_with_every_parameter_frozen_returns_its_loss() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)).requires_grad_(False)
    before = copy.deepcopy(model.state_dict())
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    pipe = sw.compile(model, 2, (x,), loss_fn=F.mse_loss, example_target=y, optimizer=ADAMW, cost="analytic",
                      schedule="1f1b", microbatches=2, split_points=["1"])
    torch.testing.assert_close(pipe.step(x, target=y), F.mse_loss(model(x), y))
    assert_state_equal(pipe.state_dict(), before)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "varuna", "harmony-pp"])
def test_stage_without_inputs(schedule: str) -> None:
    """Llama's rotary embedding alone on a stage (4 devices): its values come from a buffer and the
    sequence length, which it reads from the graph input (passes/local_sizes.py): it receives nothing."""
    torch.manual_seed(0)
    pipe, got, reference, want = train_beside_eager(
        llama(3), lm_batches(steps=2), 4, loss_fn=None, microbatches=4, schedule=schedule,
        split_points=["model.rotary_emb", "model.layers.0", "model.layers.2"])
    received = {t.dst for t in pipe.plan.transfers}
    assert any(s.index not in received and set(s.inputs) <= set(pipe.plan.graph_inputs) for s in pipe.plan.stages[1:])
    assert_trains_like_eager(pipe, got, reference, want)


def test_llama_harmony_pp_on_four_devices() -> None:
    """The issue's reproduction: harmony-pp packs every layer on its own, the rotary embedding too."""
    torch.manual_seed(0)
    pipe, got, reference, want = train_beside_eager(llama(4), lm_batches(steps=2), 4, loss_fn=None, microbatches=4,
                                                    schedule="harmony-pp")
    assert_trains_like_eager(pipe, got, reference, want)


def lora(model: nn.Module, targets: list[str], fan_in_fan_out: bool) -> nn.Module:
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, fan_in_fan_out=fan_in_fan_out)
    tuned = peft.get_peft_model(model, config)
    for name, param in tuned.named_parameters():
        if "lora_B" in name:  # peft starts B at zero; nonzero, A's gradient is too
            nn.init.normal_(param, std=0.02)
    return tuned


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_lora_trains_like_eager(family: str) -> None:
    """peft LoRA: the base frozen (unchanged, no optimizer state), the adapters trained as eager trains them."""
    torch.manual_seed(0)
    model = lora(gpt2(2), ["c_attn"], True) if family == "gpt2" else lora(llama(2), ["q_proj", "v_proj"], False)
    frozen = frozen_names(model)
    before = {k: v.clone() for k, v in model.state_dict().items() if k in frozen}
    pipe, got, reference, want = train_beside_eager(model, lm_batches(steps=2), 2, loss_fn=None, microbatches=2,
                                                    schedule="1f1b")
    assert_trains_like_eager(pipe, got, reference, want)
    state = pipe.state_dict()
    assert all(torch.equal(state[k], v) for k, v in before.items())
    assert_frozen_have_no_optimizer_state(pipe)


class SplitHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = torch.split(self.lin(x), 4, dim=-1)
        return a * b


def test_gradient_flows_into_the_items_of_a_split() -> None:
    """`split` returns a list: its items carry the gradient of what was split (else a value crossing a
    cut after it is sent without its gradient, and LoRA's q/k/v adapters never learn)."""
    graph = fx.symbolic_trace(SplitHead())
    FakeTensorProp(graph, FakeTensorMode(allow_non_fake_inputs=True)).propagate(torch.randn(2, 4))
    info = value_info(graph, 2)
    items = [n.name for n in graph.graph.nodes if n.target is operator.getitem]
    assert items and all(info[name].requires_grad for name in items)


def test_swap_planner_charges_no_gradient_or_optimizer_state_for_frozen_layers() -> None:
    """Training state per stage: weights, plus gradients and optimizer state of trainable bytes only."""
    layers = [Layer(i, f"l{i}", (), (), (), (), (), param_bytes=1000) for i in range(2)]
    stages = [Stage(0, 0, (0,), (), (), (), ()), Stage(1, 1, (1,), (), (), (), ())]
    swaps = plan_swaps("on", stages, layers, [None, None], 4.0, grad_bytes=[0, 1000])
    assert swaps.grad_bytes == {0: 0, 1: 1000} and swaps.optimizer_bytes == {0: 0, 1: 2000}
    # a capacity that holds the frozen stage's weights but not a trained stage's state
    auto = plan_swaps("auto", stages, layers, [1500, 1500], 4.0, grad_bytes=[0, 1000])
    assert auto.stages == frozenset({1})
