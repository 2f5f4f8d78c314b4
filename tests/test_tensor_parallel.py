"""Tensor parallelism within a stage (issue 26 item 1): GPT-2 and Llama with `tensor_parallel=2` on
two gloo ranks (P = 1) train like eager, their Megatron pairs found in the traced graph and split,
state_dict whole, a checkpoint of the shards loaded back; what is not supported refused before anything runs.

One spawned world runs every case (tests/harness/ranks.py); each case is checked as its own test.
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

import pytest
import torch
import torch.fx as fx

import stagewise as sw
from stagewise.ir.errors import CheckpointError, DeviceError, OptionError
from stagewise.ir.plan import Layer
from stagewise.ir.tensor_parallel import Placement
from stagewise.passes.megatron import find_blocks
from tests import hf
from tests.harness.ranks import case_results, run_cases, spawn
from tests.reference import ATOL, RTOL, assert_state_equal, eager_train, pipeline_train

CASES = ("gpt2", "llama")
LIMIT_S = 120.0
# SGD: a step moves each weight by its gradient times lr, so a gradient missing a rank's part shows;
# AdamW would turn the summation order's last-bit differences of a near-zero gradient into a full step
SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)  # momentum: optimizer state per element


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return hf.gpt2(1) if name == "gpt2" else hf.llama(1)


def _train_case(rank: int, out: str, name: str) -> dict:
    model, batches = _model(name), hf.lm_batches(steps=2)
    reference = copy.deepcopy(model)
    if rank == 1 and name == "llama":  # initialised without a common seed: rank 0's weights are the ones trained
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(torch.randn_like(parameter))
    clip = 0.5 if name == "llama" else None  # the global norm adds the shards' squares of both ranks
    pipe = sw.compile(model, ["cpu"], batches[0][0], microbatches=2, cost="analytic", optimizer=SGD,
                      tensor_parallel=2, clip_grad_norm=clip)
    local = {n: tuple(p.shape) for n, p in pipe.stages[0].named_parameters()}
    losses = pipeline_train(pipe, batches)
    norms: list[float] = []
    want = eager_train(reference, batches, optimizer=SGD, microbatches=2, clip_grad_norm=clip, norms=norms)
    state = {k: v.clone() for k, v in pipe.state_dict().items()}  # live tensors: _state_paths loads others
    result = {"losses": torch.stack(losses), "want": torch.stack(want), "state": state,
              "want_state": reference.state_dict(), "local": local, "plan": str(pipe.plan),
              "code": pipe.stages[0].code, "parallel": pipe.plan.tensor_parallel,
              "round_trip": sw.Plan.from_json(pipe.plan.to_json()) == pipe.plan, "json": pipe.plan.to_json(),
              "norm": pipe.last_grad_norm, "want_norm": norms[-1] if norms else None}
    return {**result, **_state_paths(pipe, reference, batches[0][0])} if name == "gpt2" else {**result, **_reloaded(pipe, out)}


def _reloaded(pipe, out: str) -> dict:
    """Saved (each rank its chunks of q/k/v, o and the MLP) and loaded at its own plan: the same state."""
    pipe.save(Path(out) / "llama")
    loaded = sw.load(Path(out) / "llama")
    return {"reloaded": loaded.state_dict(), "moments_reloaded": loaded.optimizer.state_dict()["state"],
            "moments": pipe.optimizer.state_dict()["state"]}


def _state_paths(pipe, reference: torch.nn.Module, inputs: dict) -> dict:
    """Evaluate against eager, the optimizer's state whole and loaded back, weights loaded, resize refused."""
    reference.eval()
    with torch.no_grad():
        eager_eval = reference(**inputs).loss
    evaluated = pipe.evaluate(**inputs)
    moments = pipe.optimizer.state_dict()
    pipe.optimizer.load_state_dict(moments)
    again = pipe.optimizer.state_dict()
    perturbed = {k: v + 1 for k, v in reference.state_dict().items()}
    pipe.load_state_dict(perturbed)
    refused = {}
    try:
        pipe.resize(["cpu"])
    except OptionError as error:
        refused["resize"] = str(error)
    return {"evaluated": evaluated, "eager_eval": eager_eval, "moments": moments, "moments_again": again,
            "perturbed": perturbed, "loaded": pipe.state_dict(), "refused": refused}


def _cases(rank: int, init_file: str, out: str) -> None:
    run_cases(rank, init_file, out, CASES, functools.partial(_train_case, rank, out))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return spawn(_cases, tmp_path_factory.mktemp("tp"), limit_s=LIMIT_S)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_two_ranks_per_stage_train_like_eager_with_full_state(trained, name):
    for result in case_results(trained, name, LIMIT_S):
        torch.testing.assert_close(result["losses"], result["want"], rtol=RTOL, atol=ATOL)
        assert_state_equal(result["state"], result["want_state"])
        assert result["round_trip"]
        if name == "llama":  # clipped: the norm of the whole model's gradient, above the limit; saved and loaded
            assert_state_equal(result["reloaded"], result["state"])
            for parameter, values in result["moments"].items():
                assert_state_equal(result["moments_reloaded"][parameter], values)
            assert result["want_norm"] > 0.5
            assert result["norm"] == pytest.approx(result["want_norm"], rel=1e-5)


def test_state_paths_see_whole_tensors(trained):
    """evaluate equals eager; optimizer state and weights read whole and load back per rank; no resize."""
    for result in case_results(trained, "gpt2", LIMIT_S):
        torch.testing.assert_close(result["evaluated"], result["eager_eval"], rtol=RTOL, atol=ATOL)
        momentum = result["moments"]["state"]["transformer.h.0.attn.c_attn.weight"]["momentum_buffer"]
        assert momentum.shape == (32, 96)
        assert_state_equal(result["moments_again"]["state"]["transformer.h.0.attn.c_attn.weight"],
                           result["moments"]["state"]["transformer.h.0.attn.c_attn.weight"])
        assert_state_equal(result["loaded"], result["perturbed"])
        assert "pipe.resize under torch.distributed" in result["refused"].get("resize", "")  # as any job of ranks


def test_gpt2_pairs_found_in_the_graph_fused_qkv_by_heads(trained):
    rank0, rank1 = case_results(trained, "gpt2", LIMIT_S)
    sharded = rank0["parallel"].sharded()
    attn = sharded["transformer.h.0.attn.c_attn.weight"]
    assert (attn.placement, attn.dim, attn.groups) == (Placement.COLUMN, 1, 3)  # Conv1D: (in, out), q k v
    proj = sharded["transformer.h.0.mlp.c_proj.weight"]
    assert (proj.placement, proj.dim) == (Placement.ROW, 0)
    assert len(rank0["parallel"].blocks) == 2  # attention and MLP; embeddings, norms and the head replicated
    assert "transformer.wte.weight" not in sharded and "transformer.h.0.attn.c_proj.bias" not in sharded
    assert rank0["local"]["transformer.h.0.attn.c_attn.weight"] == (32, 48)  # 96 columns over two ranks
    assert rank1["local"]["transformer.h.0.mlp.c_proj.weight"] == (64, 32)
    assert rank0["code"].count("tp_all_reduce(") == 2 and rank0["code"].count("tp_enter(") == 2
    assert "tensor parallel: 2 ranks per stage" in rank0["plan"] and "all-reduce after" in rank0["plan"]


def test_llama_grouped_query_attention_splits_kv_heads_with_their_q_heads(trained):
    rank0, _ = case_results(trained, "llama", LIMIT_S)
    sharded = rank0["parallel"].sharded()
    names = ("q_proj", "k_proj", "v_proj", "o_proj")
    placements = [sharded[f"model.layers.0.self_attn.{n}.weight"].placement for n in names]
    assert placements == [Placement.COLUMN] * 3 + [Placement.ROW]
    assert rank0["local"]["model.layers.0.self_attn.k_proj.weight"] == (8, 32)  # 1 of 2 kv heads of 8
    assert rank0["local"]["model.layers.0.mlp.gate_proj.weight"] == (32, 32)


@pytest.mark.parametrize(("field", "value"), [("degree", 0), ("dim", 5), ("value", -48)])
def test_a_crafted_split_in_plan_json_is_a_checkpoint_error(trained, field, value):
    text = case_results(trained, "gpt2", LIMIT_S)[0]["json"]
    data = json.loads(text)
    parallel = data["tensor_parallel"]
    target = {"degree": parallel, "dim": parallel["blocks"][0]["parameters"][0],
              "value": parallel["blocks"][0]["edits"][0]}[field]
    target[field] = value
    with pytest.raises(CheckpointError, match="tensor_parallel"):
        sw.Plan.from_json(json.dumps(data))


def test_dropout_between_a_pair_is_refused():
    """Each rank would need a stream of its own for its features' masks: an OptionError, not wrong masks."""
    gm = _mlp_graph(tied=False, dropout=0.1)
    layers = (Layer(0, "mlp", tuple(n.name for n in gm.graph.nodes), (), (), (), ()),)
    with pytest.raises(OptionError, match="dropout with p > 0 .* tensor_parallel=1"):
        find_blocks(gm, layers, 2)


def test_kv_heads_that_do_not_divide_stay_replicated():
    """Llama's 2 kv heads over 4 ranks: attention replicated with the reason, the MLP still split."""
    torch.manual_seed(0)
    model, batches = hf.llama(1), hf.lm_batches(steps=1)
    pipe = sw.compile(model, ["cpu"], batches[0][0], microbatches=1, cost="analytic")
    parallel = find_blocks(pipe.stages[0], pipe.plan.layers, 4)
    assert set(parallel.sharded()) == {f"model.layers.0.mlp.{n}_proj.weight" for n in ("gate", "up", "down")}
    assert any("self_attn" in reason and "heads" in reason for reason in parallel.unsharded)


class _Recording(fx.Interpreter):
    """Runs a hand-made graph, leaving each value in its node's meta as a capture does."""

    def run_node(self, n):
        n.meta["val"] = super().run_node(n)
        return n.meta["val"]


def _mlp_graph(tied: bool, dropout: float = 0.0) -> fx.GraphModule:
    """x -> linear(fc1) -> relu -> dropout -> linear(fc2) -> linear(head): head's weight is fc1's where tied."""
    root = torch.nn.Module()
    for name, shape in (("fc1", (8, 4)), ("fc2", (4, 8)), ("head", (8, 4))):
        setattr(root, name, torch.nn.Module())
        getattr(root, name).weight = torch.nn.Parameter(torch.randn(shape))
    if tied:
        root.head.weight = root.fc1.weight
    graph = fx.Graph()
    x = graph.placeholder("x")
    hidden = graph.call_function(torch.ops.aten.linear.default, (x, graph.get_attr("fc1.weight")))
    hidden = graph.call_function(torch.ops.aten.relu.default, (hidden,))
    hidden = graph.call_function(torch.ops.aten.dropout.default, (hidden, dropout, False))
    hidden = graph.call_function(torch.ops.aten.linear.default, (hidden, graph.get_attr("fc2.weight")))
    graph.output(graph.call_function(torch.ops.aten.linear.default, (hidden, graph.get_attr("head.weight"))))
    gm = fx.GraphModule(root, graph)
    _Recording(gm).run(torch.randn(2, 4))
    return gm


@pytest.mark.parametrize("tied", [False, True])
def test_a_weight_tied_under_another_name_stays_whole(tied):
    """fc1 -> relu -> fc2 is a pair, unless fc1's weight is also the head's (read under its other name)."""
    gm = _mlp_graph(tied)
    layers = (Layer(0, "mlp", tuple(n.name for n in gm.graph.nodes), (), (), (), ()),)
    parallel = find_blocks(gm, layers, 2)
    if tied:
        assert not parallel.blocks and any("fc1.weight is used elsewhere" in r for r in parallel.unsharded)
    else:
        assert [(p.name, p.placement) for p in parallel.blocks[0].parameters] == [
            ("fc1.weight", Placement.COLUMN), ("fc2.weight", Placement.ROW)]


@pytest.mark.parametrize("given", [0, True, 2.0, "2"])
def test_bad_degree_is_an_option_error(given):
    model = torch.nn.Linear(4, 4)
    with pytest.raises(OptionError, match="tensor_parallel="):
        sw.compile(model, ["cpu"], (torch.randn(2, 4),), loss_fn=torch.nn.functional.mse_loss,
                   example_target=torch.randn(2, 4), tensor_parallel=given)


def test_degree_without_its_ranks_or_with_compiled_stages_is_refused():
    model, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    kwargs = dict(loss_fn=torch.nn.functional.mse_loss, example_target=torch.randn(2, 4), tensor_parallel=2)
    with pytest.raises(DeviceError, match="nproc-per-node 2"):
        sw.compile(model, ["cpu"], (x,), **kwargs)
    with pytest.raises(OptionError, match="compile_stages"):
        sw.compile(model, ["cpu"], (x,), compile_stages=True, **kwargs)
    with pytest.raises(DeviceError, match="2 pipeline devices x 2.*nproc-per-node 4"):  # T x P: T·P ranks
        sw.compile(model, ["cpu", "cpu"], (x,), **kwargs)
