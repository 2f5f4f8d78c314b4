"""Writing a checkpoint (the layout: compiler/checkpoint.py; the marker and the checks:
compiler/checkpoint_files.py; how it is put in place safely: compiler/checkpoint_swap.py).

Save refuses a target that holds anything but a stagewise checkpoint, and a crash at any moment
leaves the old or the new checkpoint loadable there. Under torch.distributed every rank
snapshots its stages to CPU memory and gathers them to rank 0, which writes them; every rank
returns only after the rename (or raises the same failure).
"""

from __future__ import annotations

import copy
import io
from pathlib import Path

import torch
import torch.fx as fx

from stagewise.codegen.source import stage_source
from stagewise.compiler.checkpoint_files import FileRecord
from stagewise.compiler.checkpoint_swap import publish, put
from stagewise.compiler.runtime_setup import Runtime
from stagewise.ir.errors import PlanError
from stagewise.ir.plan import Plan
from stagewise.runtime.distributed import DistributedTransport
from stagewise.runtime.worker import StageWorker


def save(plan: Plan, runtime: Runtime, directory, unheld: dict[str, torch.Tensor], training: dict) -> None:
    """Write the pipeline of `plan`, the state no stage holds (`unheld`, every rank's alike) and the
    training loop's state (`training`: the scheduler's state, user metadata; rank 0's) to
    `directory`, atomically; under torch.distributed every rank must call it."""
    if runtime.context is None:
        records = (_snapshot(plan, worker) for worker in runtime.workers)  # one stage at a time
        _write(plan, runtime, Path(directory), records, unheld, training)
        return
    _save_distributed(plan, runtime, Path(directory), unheld, training)


def _save_distributed(plan: Plan, runtime: Runtime, target: Path, unheld: dict[str, torch.Tensor],
                      training: dict) -> None:
    """Gather every rank's stages to rank 0, which writes them; everyone returns after the rename."""
    transport = runtime.transport
    if not isinstance(transport, DistributedTransport):
        raise PlanError("saving across ranks needs the torch.distributed transport")
    transport.barrier(
        f"pipe.save({str(target)!r})",
        "under torch.distributed every rank must call pipe.save(directory) (each holds only its own stages), "
        "not only rank 0",
    )
    mine: list[dict] | str  # this rank's stages, or why it could not snapshot them
    local_error: BaseException | None = None
    try:
        mine = [_snapshot(plan, worker) for worker in runtime.workers]
    except Exception as error:  # noqa: BLE001 - sent to rank 0 so that no rank waits for it
        mine, local_error = f"{type(error).__name__}: {error}", error
    parts = transport.gather_to_first(mine)
    outcome: str | None = None
    if parts is not None:  # rank 0
        failed = [f"rank {r}: {p}" for r, p in enumerate(parts) if isinstance(p, str)]
        if failed:
            outcome = f"the checkpoint was not written: {'; '.join(failed)}"
        else:
            try:
                _write(plan, runtime, target, (record for part in parts for record in part), unheld, training)
            except Exception as error:  # noqa: BLE001 - told to the other ranks, then re-raised
                local_error = local_error or error
                outcome = f"rank 0 could not write {target} ({type(error).__name__}: {error})"
    outcome = transport.from_first(outcome)  # the barrier: the rename is done (or failed)
    if local_error is not None:
        raise local_error
    if outcome is not None:
        raise PlanError(f"pipe.save({str(target)!r}) failed, {outcome}; any earlier checkpoint there is intact")


def _snapshot(plan: Plan, worker: StageWorker) -> dict:
    """One stage as the checkpoint holds it: its source, and its stage_<i>.pt already serialised
    here (so a rank that cannot serialise its stage says so instead of failing mid-collective):
    tensors and optimizer state on the CPU, host copies standing in for what a swapped stage
    keeps off the device between steps."""
    state = io.BytesIO()
    torch.save({"attrs": _cpu_attrs(worker), "optimizer": worker.optimizer_state()}, state)
    return {
        "index": worker.stage.index,
        "source": stage_source(worker.module, _stage_doc(plan, worker)),
        "state": state.getvalue(),
        "swapped": worker.swapped,
    }


def _write(plan: Plan, runtime: Runtime, target: Path, records, unheld: dict[str, torch.Tensor],
           training: dict) -> None:
    """Write the plan and the stage records into a staging directory beside `target`, then swap it
    in (compiler/checkpoint_swap.py)."""

    def fill(staging: Path) -> dict[str, FileRecord]:
        files = {
            "plan.json": put(staging / "plan.json", plan.to_json()),
            "programs.txt": put(staging / "programs.txt", "\n\n".join(str(p) for p in plan.programs) + "\n"),
        }
        swapped = set()
        for record in records:
            i = record["index"]
            files[f"stage_{i}.py"] = put(staging / f"stage_{i}.py", record["source"])
            files[f"stage_{i}.pt"] = put(staging / f"stage_{i}.pt", record["state"])
            if record["swapped"]:
                swapped.add(i)
        missing = sorted(s.index for s in plan.stages if f"stage_{s.index}.pt" not in files)
        if missing:
            raise PlanError(f"no rank held stages {missing}; the checkpoint would be incomplete")
        files["runtime.pt"] = put(staging / "runtime.pt", _runtime_settings(runtime, swapped, training))
        if unheld:
            files["unused.pt"] = put(staging / "unused.pt", _serialised(unheld))
        return files

    publish(target, fill)


def _runtime_settings(runtime: Runtime, swapped: set[int], training: dict) -> bytes:
    """runtime.pt: what load needs to rebuild the runtime besides the stages; `step`, the steps
    completed, keys the random streams of the steps to come (with the plan's seed); `training`,
    what `pipe.save` was given for the training loop."""
    return _serialised(
        {"optimizer": runtime.optimizer_factory, "clip_grad_norm": runtime.clip_grad_norm, "swapped": frozenset(swapped),
         "step": runtime.executor.iteration, **training,
         "loss_scaler": None if runtime.executor.scaler is None else runtime.executor.scaler.state_dict()}
    )


def _serialised(value: object) -> bytes:
    data = io.BytesIO()
    torch.save(value, data)
    return data.getvalue()


def _stage_doc(plan: Plan, worker: StageWorker) -> str:
    stage = worker.stage
    layers = [plan.layers[j].name for j in stage.layers]
    return (
        f"Stage {stage.index} of {plan.model}, generated by stagewise.\n\n"
        f"Layers: {', '.join(layers)}.\nInputs: {', '.join(stage.inputs)}.\n"
        f"Outputs: {', '.join(stage.outputs)}.\n"
    )


def _cpu_attrs(worker: StageWorker) -> dict[str, object]:
    """`_attrs` of the stage, copied so that every tensor is a CPU tensor holding its real value.

    Tensors already on the CPU and in place are shared, not copied; the rest (device tensors,
    parameters of a swapped stage, which are empty on the device and live in host memory) are
    copied once each, so tied tensors stay one tensor.
    """
    module = worker.module
    values = worker.state_tensors()  # host copies stand in for swapped-out parameters
    memo: dict[int, object] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in memo:
            continue
        if param.device.type == "cpu" and param.numel() > 0:
            memo[id(param)] = param
        else:
            memo[id(param)] = torch.nn.Parameter(values[name].detach().to("cpu", copy=True),
                                                 requires_grad=param.requires_grad)
    for tensor in [b for _, b in module.named_buffers(remove_duplicate=False)] + [
        v for v in _attrs(module).values() if isinstance(v, torch.Tensor)
    ]:
        if id(tensor) not in memo:
            memo[id(tensor)] = tensor if tensor.device.type == "cpu" else tensor.detach().to("cpu")
    return copy.deepcopy(_attrs(module), memo)


def _attrs(module: fx.GraphModule) -> dict[str, object]:
    """The objects the stage code reaches by FQN: leaf submodules and top-level tensors."""
    attrs: dict[str, object] = {}
    graph = module.graph
    for node in graph.nodes:
        if node.op == "call_module":
            attrs[node.target] = module.get_submodule(node.target)
        elif node.op == "get_attr":
            *path, leaf = node.target.split(".")
            owner = module.get_submodule(".".join(path)) if path else module
            attrs[node.target] = getattr(owner, leaf)
    return attrs
