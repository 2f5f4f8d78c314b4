"""The model as a checkpoint keeps it for planning again, without the model's class (graph.json).

Varuna (§4.5) morphs a job onto the machines it has now by planning again. A checkpoint's stages
are cut for the devices they were saved on; to plan for others, `compile` records the whole
graph it planned (model and loss at the plan's microbatch size, before its random ops were keyed)
as data (codegen/graph_data.py), each node with the layer it was in, every state_dict entry's
kind, and the compile options that still mean something on other devices. `pipe.save` writes it
beside the stages; `sw.load(directory, devices=...)` rebuilds from it a stand-in for the model
(`stand_in`: the graph as a module under the model's own names) and plans it again
(compiler/elastic/replan.py). Like the stages, nothing in it runs on load: calls resolve by exact name
from the allowlist (codegen/allowlist.py) or the caller's `trusted_functions`, and `sw.load`
checks it (compiler/checkpoint/verify.py) whether it plans again or not.

    {"format": "stagewise.model/1", "model": "GPT2LMHeadModel", "tracer": "export",
     "graph": {... stage structure, each compute node with "layer": "transformer.h.0" ...},
     "state": {"transformer.wte.weight": ["parameter", true], "attn.bias": ["buffer", false], ...},
     "options": {"schedule": "auto", "microbatches": null, "virtual_devices": null, ...}}

A graph that cannot be described as data (a tensor subclass, a lambda in the graph) is recorded as
{"format": ..., "unavailable": why}: such a checkpoint loads on its own plan, and onto other
devices through the model (`compile` + `pipe.restore`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict

import torch
import torch.fx as fx

from stagewise.codegen.graph_data import materialize, stage_structure
from stagewise.compiler.assembly.options import CompileOptions
from stagewise.compiler.checkpoint.dcp import CONSTANTS, MODEL, read_tensors
from stagewise.compiler.checkpoint.read import Checkpoint
from stagewise.compiler.checkpoint.write import GRAPH_FILE as FILE
from stagewise.compiler.compile.analysis import Analysed
from stagewise.ir.errors import CheckpointError, PlanError
from stagewise.ir.subgraph import LAYER_NAME

FORMAT = "stagewise.model/1"
_PLAIN_INIT_STD = 0.02  # the stand-in's weights before the restore: only the profiler runs them


def describe_model(model: torch.nn.Module, graph: Analysed, tracer: str, options: CompileOptions,
                   virtual_devices: int | None) -> dict:
    """graph.json's content for a pipeline compiled from `model` on `graph` (module docstring)."""
    try:
        structure = stage_structure(graph.graph)
    except PlanError as error:
        return {"format": FORMAT, "unavailable": str(error)}
    layer_of = {name: layer.name for layer in graph.layers for name in layer.nodes}
    for record in structure["nodes"]:
        if record["name"] in layer_of:
            record["layer"] = layer_of[record["name"]]
    state = {name: ["parameter" if isinstance(t, torch.nn.Parameter) else "buffer", bool(t.requires_grad)]
             for name, t in model.state_dict(keep_vars=True).items() if isinstance(t, torch.Tensor)}
    return {"format": FORMAT, "model": type(model).__name__, "tracer": tracer, "graph": structure, "state": state,
            "options": _replan_options(options, virtual_devices)}


def _replan_options(options: CompileOptions, virtual_devices: int | None) -> dict:
    """The options a plan for other devices keeps. A count of stages or replicas, and split points,
    were chosen for these devices: on others the planner searches (Varuna's P x D, §4.5)."""
    fixed_layout = isinstance(options.replicas, int) and options.replicas > 1 or isinstance(options.replicas, tuple)
    return {"schedule": options.schedule, "microbatches": options.microbatches, "cost": options.cost,
            "swap": options.swap, "replicas": "auto" if fixed_layout else options.replicas,
            "stages": options.stages if options.stages in (None, "auto") else None,
            "optimizer_on_host": options.optimizer_on_host, "activations": options.activations,
            "precision": options.precision, "asynchronous": options.asynchronous,
            "loss_scaling": None if options.loss_scaling is None else asdict(options.loss_scaling),
            "virtual_devices": virtual_devices}


def usable(model_graph: dict | None, graph: fx.GraphModule | None, root: object) -> tuple[dict, fx.GraphModule]:
    """`model_graph` and `graph` (what it rebuilt) if it describes one; else a CheckpointError saying how to
    load onto other devices."""
    fix = "compile the model for the new devices and call pipe.restore(directory)"
    if model_graph is None:
        raise CheckpointError(f"{root} holds no graph of the model to plan again from (saved before stagewise "
                              f"kept one): {fix}")
    if model_graph.get("format") != FORMAT:
        raise CheckpointError(f"{root}/{FILE} is of format {model_graph.get('format')!r}, not {FORMAT}: load it with "
                              f"the stagewise that wrote it, or {fix}")
    if "unavailable" in model_graph:
        raise CheckpointError(f"{root} holds no graph of the model to plan again from: it could not be saved as "
                              f"data ({model_graph['unavailable']}); {fix}")
    if graph is None:
        raise CheckpointError(f"{root}/{FILE} holds no 'graph' to plan again from: {fix}")
    return model_graph, graph


def stand_in(model_graph: dict, saved: Checkpoint, module: fx.GraphModule) -> fx.GraphModule:
    """The saved graph (`module`: graph.json's, rebuilt on the meta device by compiler/checkpoint/verify.py)
    as a module holding every state_dict entry under the model's names (ties kept), on the CPU:
    weights drawn at random (the profiler times them; the restore replaces them), buffers and
    constants read from the checkpoint (masks, position ids, statistics)."""
    layers = {r.get("name"): r["layer"] for r in model_graph["graph"]["nodes"] if isinstance(r, dict) and "layer" in r}
    for node in module.graph.nodes:
        if node.name in layers:
            node.meta[LAYER_NAME] = str(layers[node.name])
    _add_unread_state(module, model_graph.get("state", {}), saved)
    _outside_state_dict(module, set(model_graph.get("state", {})))
    _in_order(module, saved.plan.state_names)
    materialize(module, "cpu")
    _fill(module, set(model_graph.get("state", {})), saved)
    return module


def _add_unread_state(module: torch.nn.Module, state: Mapping[str, list], saved: Checkpoint) -> None:
    """The state_dict entries the graph does not read (a layer the loss never reaches, the other
    name of a tie), so the stand-in's state_dict is the model's."""
    present = dict([*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)])
    for group in saved.plan.aliases:
        owner = next((present[name] for name in group if name in present), None)
        for name in group:
            if owner is not None and name not in present:
                _register(module, name, owner)
                present[name] = owner
    for name, (kind, requires_grad) in state.items():
        if name in present:
            continue
        meta = saved.tensors.get(f"{MODEL}.{name}")
        if meta is None:
            raise CheckpointError(f"{saved.root} holds no weights for {name}, which {FILE} lists")
        tensor = torch.empty(tuple(meta.size), dtype=meta.properties.dtype, device="meta")
        _register(module, name, torch.nn.Parameter(tensor, bool(requires_grad)) if kind == "parameter" else tensor)
        present[name] = tensor


def _in_order(module: torch.nn.Module, names: tuple[str, ...]) -> None:
    """Children, parameters and buffers in the model's state_dict order (the graph met them in its
    own), so that the first name of a tie, the groups' order and state_dict() are the model's."""
    rank: dict[str, int] = {}
    for index, name in enumerate(names):
        parts = name.split(".")
        for depth in range(1, len(parts) + 1):
            rank.setdefault(".".join(parts[:depth]), index)
    for path, owner in module.named_modules(remove_duplicate=False):
        prefix = f"{path}." if path else ""
        for table in (owner._modules, owner._parameters, owner._buffers):
            ordered = sorted(table.items(), key=lambda item: rank.get(prefix + item[0], len(names)))
            table.clear()
            table.update(ordered)


def _outside_state_dict(module: torch.nn.Module, state_names: set[str]) -> None:
    """Buffers the model's state_dict did not have (lifted constants the trace made buffers of) left
    out of the stand-in's, as they were left out of the model's."""
    for fqn, _ in module.named_buffers(remove_duplicate=False):
        if fqn not in state_names:
            prefix, _, name = fqn.rpartition(".")
            (module.get_submodule(prefix) if prefix else module)._non_persistent_buffers_set.add(name)


def _register(root: torch.nn.Module, fqn: str, tensor: torch.Tensor) -> None:
    """Put `tensor` at `fqn`, making plain parent modules where the graph had none."""
    *path, leaf = fqn.split(".")
    owner = root
    for part in path:
        if not hasattr(owner, part):
            owner.add_module(part, torch.nn.Module())
        owner = getattr(owner, part)
    if isinstance(tensor, torch.nn.Parameter):
        owner.register_parameter(leaf, tensor)
    else:
        owner.register_buffer(leaf, tensor)


def _fill(module: torch.nn.Module, state_names: set[str], saved: Checkpoint) -> None:
    """Random weights; buffers and constants as saved (DCP reads them, this process alone)."""
    with torch.no_grad():
        for parameter in module.parameters():
            if parameter.is_floating_point():
                parameter.normal_(0.0, _PLAIN_INIT_STD)
            else:
                parameter.zero_()
        wanted = {}
        for name, buffer in module.named_buffers():  # once per tie
            key = f"{MODEL}.{name}" if name in state_names else f"{CONSTANTS}.{name}"
            if key in saved.tensors:
                wanted[key] = buffer
            else:
                buffer.zero_()
        read_tensors(saved.weights, saved.tensors, wanted, None)
