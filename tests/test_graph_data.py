"""Stage modules described as JSON data and rebuilt from it (codegen/graph_data.py): the same
generated code and the same outputs, without exec, pickle or imports outside the allowlist."""

import functools
import json
import re
import sys
from itertools import chain

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import stagewise as sw
from stagewise.codegen import allowlist
from stagewise.codegen.graph_data import build_stage, materialize, stage_structure, stage_tensors
from stagewise.codegen.graph_names import callable_name
from stagewise.codegen.module_skeleton import describe_module, rebuild_module
from stagewise.compiler.checkpoint.read import trusted_by_name
from stagewise.ir.errors import CheckpointError, PlanError, UntrustedCodeError
from stagewise.ir.random_streams import drawing
from tests.hf import gpt2, llama
from tests.models.gpt import lm_loss
from tests.models.resnet_inplace import ResNetInplace

_OPTIMIZER = functools.partial(torch.optim.AdamW, lr=1e-3)


class TiedLeaves(nn.Module):
    """fx-traced leaves: Embedding, LayerNorm, Linear, ReLU, GELU, a Dropout that stays a leaf (p=0)
    and one that draws (keyed_dropout); the head tied to the embedding (an alias in one stage)."""

    def __init__(self, vocab: int = 32, dim: int = 16):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.ln = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)
        self.relu = nn.ReLU(inplace=True)
        self.keep = nn.Dropout(0.0)
        self.drop = nn.Dropout(0.1)
        self.act = nn.GELU()
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.keep(self.relu(self.fc(self.ln(self.tok(idx)))))
        return self.head(self.drop(self.act(x)))


class Scale(nn.Module):
    """A leaf that is not a torch.nn class: not rebuildable."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * x


def double(x: torch.Tensor) -> torch.Tensor:
    """A user's function: loaded only when passed in `trusted`."""
    return 2 * x


@pytest.fixture(scope="module")
def tied():
    ids = torch.randint(0, 32, (4, 6))
    pipe = sw.compile(TiedLeaves(), ["cpu"], (ids,), example_target=ids, loss_fn=lm_loss, cost="analytic",
                      optimizer=_OPTIMIZER)
    return pipe, {"idx": ids, "target": ids}


@pytest.fixture(scope="module")
def resnet():
    x, y = torch.randn(2, 3, 8, 8), torch.tensor([1, 2])
    pipe = sw.compile(ResNetInplace(), ["cpu", "cpu"], (x,), example_target=y, cost="analytic",
                      loss_fn=nn.functional.cross_entropy, optimizer=_OPTIMIZER)
    return pipe, {"x": x, "target": y}


def _hf(model, devices: int):
    ids = torch.randint(1, 128, (2, 8))
    pipe = sw.compile(model, ["cpu"] * devices, {"input_ids": ids, "labels": ids}, cost="analytic", optimizer=_OPTIMIZER)
    return pipe, {"input_ids": ids, "labels": ids}


def _round_trip(module: fx.GraphModule) -> tuple[dict, fx.GraphModule]:
    """structure -> JSON text -> module on the meta device -> CPU, the original's values copied by name."""
    structure = stage_structure(module)
    text = json.dumps(structure, sort_keys=True)
    rebuilt = build_stage(json.loads(text), type(module).__name__)
    assert all(t.is_meta for t in chain(rebuilt.parameters(), rebuilt.buffers()))
    materialize(rebuilt, "cpu")
    source, target = stage_tensors(module), stage_tensors(rebuilt)
    assert list(source) == list(target)
    with torch.no_grad():
        for name, tensor in source.items():
            assert (target[name].shape, target[name].dtype, target[name].requires_grad) == \
                (tensor.shape, tensor.dtype, tensor.requires_grad), name
            target[name].copy_(tensor)
    assert rebuilt.code == module.code
    assert list(rebuilt.state_dict()) == list(module.state_dict())
    assert [n for n, _ in rebuilt.named_parameters()] == [n for n, _ in module.named_parameters()]
    assert json.dumps(stage_structure(rebuilt), sort_keys=True) == json.dumps(_as_rebuilt(structure), sort_keys=True)
    return structure, rebuilt


def _as_rebuilt(structure: dict) -> dict:
    """The structure with constants as the non-persistent buffers they come back as (so they move)."""
    tensors = {name: {**record, "kind": "buffer", "persistent": False} if record["kind"] == "constant" else record
               for name, record in structure["tensors"].items()}
    return {**structure, "tensors": tensors}


def _same_outputs(pipe, batch: dict) -> list[dict]:
    """Every stage rebuilt and run beside the original on the same inputs (the keyed random streams
    drawn alike); the structures."""
    structures, env = [], dict(batch)
    for worker in pipe._runtime.workers:
        structure, rebuilt = _round_trip(worker.module)
        args = [env[name] for name in worker.stage.inputs]
        with drawing(seed=7, step=0, microbatch=0):
            expected = worker.module(*args)
        with drawing(seed=7, step=0, microbatch=0):
            got = rebuilt(*args)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        env.update(zip(worker.stage.outputs, expected, strict=True))
        structures.append(structure)
    return structures


def test_fx_leaves_and_a_tie_in_one_stage(tied):
    pipe, batch = tied
    structure, = _same_outputs(pipe, batch)
    assert structure["tensors"]["head.weight"] == {"kind": "parameter", "alias_of": "tok.weight"}
    classes = {m["class"][1] for m in structure["modules"].values()}
    assert {"Embedding", "LayerNorm", "Linear", "ReLU", "Dropout", "GELU"} <= classes
    targets = [n["target"] for n in structure["nodes"] if n["op"] == "call_function"]
    assert {"function": ["stagewise.ir.random_streams", "keyed_dropout"]} in targets
    rebuilt = build_stage(structure, "Stage0")
    materialize(rebuilt, "cpu")
    assert rebuilt.head.weight is rebuilt.tok.weight  # to_empty alone would untie them
    assert list(stage_tensors(rebuilt)) == ["tok.weight", "ln.weight", "ln.bias", "fc.weight", "fc.bias"]


def test_conv_batchnorm_stages(resnet):
    pipe, batch = resnet
    structures = _same_outputs(pipe, batch)
    classes = {m["class"][1] for s in structures for m in s["modules"].values()}
    assert {"Conv2d", "BatchNorm2d", "ReLU", "AdaptiveAvgPool2d", "Linear"} <= classes
    assert structures[0]["tensors"]["bn1.running_mean"]["kind"] == "buffer"


def test_gpt2_through_torch_export():
    pipe, batch = _hf(gpt2(1), devices=2)
    structures = _same_outputs(pipe, batch)
    ops = {n["target"]["op"] for s in structures for n in s["nodes"]
           if isinstance(n["target"], dict) and "op" in n["target"]}  # a str target ("output") may contain "op"
    assert {"aten.embedding.default", "aten.addmm.default", "aten.scaled_dot_product_attention.default"} <= ops
    # torch.export names the tied embedding and head once: each stage reads it as lm_head.weight
    assert all("lm_head.weight" in s["tensors"] and "transformer.wte.weight" not in s["tensors"] for s in structures)
    assert structures[0] == stage_structure(pipe._runtime.workers[0].module)


def test_llama_rotary_buffer_and_lifted_constants():
    pipe, batch = _hf(llama(1), devices=1)
    first, = _same_outputs(pipe, batch)
    assert first["tensors"]["model.rotary_emb.inv_freq"]["kind"] == "buffer"
    assert any(".lifted_tensor_" in name for name in first["tensors"])
    assert "model.rotary_emb.inv_freq" in stage_tensors(pipe._runtime.workers[0].module)


def test_structure_is_deterministic(tied):
    module = tied[0]._runtime.workers[0].module
    assert json.dumps(stage_structure(module), sort_keys=True) == json.dumps(stage_structure(module), sort_keys=True)


def _tied_constant_module() -> fx.GraphModule:
    """get_attr reads as torch.export leaves them: one parameter under two names, a plain tensor
    constant and a non-persistent buffer."""
    root = nn.Module()
    root.a, root.b = nn.Module(), nn.Module()
    root.a.w = root.b.w = nn.Parameter(torch.randn(3))
    root.register_buffer("_tensor_constant0", torch.arange(3.0))
    root.register_buffer("stat", torch.ones(3))
    graph = fx.Graph()
    x = graph.placeholder("x")
    aw, bw, c, s = (graph.get_attr(t) for t in ("a.w", "b.w", "_tensor_constant0", "stat"))
    y = graph.call_function(torch.ops.aten.mul.Tensor, (x, aw))
    z = graph.call_function(torch.add, (y, bw), {"alpha": float("inf")})
    graph.output((graph.call_function(torch.ops.aten.add.Tensor, (z, c)), s, slice(None, 2), ..., torch.float16))
    module = fx.GraphModule(root, graph)
    del module._tensor_constant0, module.stat  # fx.GraphModule registered both as persistent buffers
    module._tensor_constant0 = torch.arange(3.0)  # a plain attribute: neither parameter nor buffer
    module.register_buffer("stat", torch.ones(3), persistent=False)
    return module


def test_get_attr_alias_constant_and_non_persistent_buffer():
    module = _tied_constant_module()
    structure, rebuilt = _round_trip(module)
    tensors = structure["tensors"]
    assert tensors["b.w"] == {"kind": "parameter", "alias_of": "a.w"}
    assert tensors["_tensor_constant0"]["kind"] == "constant"
    assert tensors["stat"] == {"kind": "buffer", "persistent": False, "shape": [3], "dtype": "float32",
                               "requires_grad": False}
    assert rebuilt.a.w is rebuilt.b.w
    assert "_tensor_constant0" in dict(rebuilt.named_buffers()) and "_tensor_constant0" not in rebuilt.state_dict()
    x = torch.randn(3)
    got, expected = rebuilt(x), module(x)
    torch.testing.assert_close(got[:2], expected[:2], rtol=0, atol=0)
    assert got[2:] == expected[2:] == (slice(None, 2), ..., torch.float16)


def test_symbolic_trace_leaves_inplace_and_dtypes():
    """fx.symbolic_trace keeps ReLU(inplace=True) and MaxPool2d; a frozen float64 leaf stays so."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(4, momentum=None),
                          nn.ReLU(inplace=True), nn.MaxPool2d(2, ceil_mode=True), nn.Flatten(), nn.Linear(16, 2))
    model = model.double().eval()
    model[5].weight.requires_grad_(False)
    module = fx.symbolic_trace(model)
    structure, rebuilt = _round_trip(module)
    assert structure["modules"]["2"]["arguments"] == {"inplace": True}
    assert structure["modules"]["1"]["training"] is False and not rebuilt.get_submodule("1").training
    assert structure["tensors"]["5.weight"]["requires_grad"] is False
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    torch.testing.assert_close(rebuilt(x), module(x), rtol=0, atol=0)


@pytest.mark.parametrize("module", [
    nn.Linear(3, 4, bias=False), nn.LayerNorm(5, eps=1e-6), nn.Embedding(10, 4, padding_idx=0), nn.Dropout(0.3),
    nn.ReLU(inplace=True), nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8, momentum=None),
    nn.GELU("tanh"), nn.MaxPool2d(3, stride=2, ceil_mode=True), nn.AdaptiveAvgPool2d((1, 1)),
], ids=lambda m: type(m).__name__)
def test_torch_nn_skeletons(module):
    skeleton = describe_module(module)
    assert skeleton["rebuildable"], skeleton
    rebuilt = rebuild_module(json.loads(json.dumps(skeleton)))
    assert repr(rebuilt) == repr(module) and all(t.is_meta for t in rebuilt.parameters())


def test_a_skeleton_that_rebuilds_otherwise_is_not_rebuildable():
    linear = nn.Linear(4, 4)
    linear.in_features = 5  # the constructor would make a (4, 5) weight
    skeleton = describe_module(linear)
    assert skeleton["rebuildable"] is False and "('weight', (4, 5))" in skeleton["reason"]


def _calling(target, leaf: nn.Module | None = None) -> fx.GraphModule:
    root = nn.Module()
    graph = fx.Graph()
    value = graph.call_function(target, (graph.placeholder("x"),))
    if leaf is not None:
        root.leaf = leaf
        value = graph.call_module("leaf", (value,))
    graph.output(value)
    return fx.GraphModule(root, graph)


def test_a_custom_leaf_is_recorded_and_refused_on_load():
    structure = stage_structure(_calling(torch.relu, Scale()))
    assert structure["modules"]["leaf"] == {"class": ["tests.test_graph_data", "Scale"], "rebuildable": False,
                                            "reason": "tests.test_graph_data.Scale is not a torch.nn class"}
    with pytest.raises(CheckpointError, match=r"tests\.test_graph_data\.Scale.*compile the model again"):
        build_stage(structure, "Stage0")


@pytest.mark.parametrize("name", [["os", "system"], ["builtins", "eval"], ["this", "s"], ["torch", "load"]])
def test_targets_outside_the_allowlist_are_refused(name):
    structure = stage_structure(_calling(torch.relu))
    structure["nodes"][1]["target"] = {"function": name}
    with pytest.raises(CheckpointError, match=re.escape(f"node 'relu': it calls {'.'.join(name)}") + r".*trusted_functions=\["):
        build_stage(structure, "Stage0")
    assert "this" not in sys.modules  # refused by name, never imported


@pytest.mark.parametrize("function", [double, torch.trapezoid], ids=["own", "torch-not-listed"])
def test_a_function_off_the_list_is_saved_and_loads_only_when_trusted(function):
    """Saving names any function it finds by name; loading takes one off the list only from
    trusted_functions, as sw.load passes them (torch.trapezoid's __qualname__ is not its name)."""
    module = _calling(function)
    structure = stage_structure(module)
    name = f"{function.__module__}.{function.__name__}"
    assert structure["nodes"][1]["target"] == {"function": name.rsplit(".", 1)}
    with pytest.raises(UntrustedCodeError, match=rf"{re.escape(name)}.*trusted_functions=\[{function.__name__}\]"):
        build_stage(structure, "Stage0")
    rebuilt = build_stage(structure, "Stage0", trusted_by_name([function]))
    x = torch.randn(3)
    torch.testing.assert_close(rebuilt(x), module(x))


def test_an_op_outside_aten_loads_only_when_trusted():
    """Another namespace's ops may run Python (torch.library): only the very op passed in."""
    op = torch.ops.prims.view_of.default
    module = _calling(op)
    structure = stage_structure(module)
    assert structure["nodes"][1]["target"] == {"op": "prims.view_of.default"}
    with pytest.raises(UntrustedCodeError, match=r"torch\.ops\.prims\.view_of\.default: a checkpoint calls ATen"):
        build_stage(structure, "Stage0")
    rebuilt = build_stage(structure, "Stage0", trusted_by_name([op]))
    x = torch.randn(3)
    torch.testing.assert_close(rebuilt(x), module(x))


_X = {"node": "x"}


@pytest.mark.parametrize(("edit", "message"), [
    ({"target": {"function": ["builtins", "getattr"]}, "args": [_X, "__class__"]}, "__class__"),
    ({"op": "call_method", "target": "tofile", "args": [_X, "/tmp/x"]}, "tofile"),
    ({"target": {"function": ["torch.utils._pytree", "tree_map"]}, "args": [{"function": ["builtins", "getattr"]}, _X]},
     "passes builtins.getattr on as a value"),
    ({"kwargs": [["x); import os; (", 1]]}, "keyword argument"),
    ({"op": "get_attr", "target": 'a"); import os; ("', "args": []}, "not a plain name"),
    ({"target": {"op": "higher_order.cond"}}, "higher_order.cond"),
], ids=["dunder-getattr", "tofile", "getattr-as-value", "keyword", "attribute", "higher-order-op"])
def test_code_injections_are_refused(edit, message):
    structure = stage_structure(_calling(torch.relu))
    structure["nodes"][1].update(edit)
    with pytest.raises(CheckpointError, match=message):
        build_stage(structure, "Stage0")


def test_values_that_cannot_be_described_name_the_node():
    with pytest.raises(PlanError, match="node '_lambda_'"):
        stage_structure(_calling(lambda x: x))
    root, graph = nn.Module(), fx.Graph()
    graph.output(graph.call_function(torch.add, (graph.placeholder("x"), 1j)))
    with pytest.raises(PlanError, match=r"node 'add'.*holds 1j \(a complex\)"):
        stage_structure(fx.GraphModule(root, graph))


@pytest.mark.parametrize(("listing", "lookup"), [
    (allowlist.FUNCTIONS, allowlist.allowed_function), (allowlist.CLASSES, allowlist.allowed_class),
    (allowlist.ENUMS, allowlist.allowed_enum), (allowlist.LEAF_MODULES, allowlist.allowed_leaf),
    (allowlist.OPTIMIZERS, allowlist.allowed_optimizer),
], ids=["functions", "classes", "enums", "leaves", "optimizers"])
def test_every_listed_name_is_found_under_the_name_a_structure_records(listing, lookup):
    """A misspelt entry would quietly refuse what it meant to allow; a function listed under
    another name than torch.fx records would be refused when loaded."""
    names = [f"{module}.{name}" for module, listed in listing.items() for name in listed.split()]
    assert [name for name in names if lookup(name) is None] == []
    if listing is allowlist.FUNCTIONS:
        recorded = {name: callable_name(lookup(name)) for name in names}
        assert {n: r for n, r in recorded.items() if r != {"function": n.rsplit(".", 1)}} == {}
    assert all(hasattr(torch.ops.aten, op) for op in allowlist.ATEN_REFUSED)
