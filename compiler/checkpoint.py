"""Save a pipeline to a directory and load it back without the model class or re-tracing.

Layout: plan.json (the whole IR, programs included), programs.txt (readable), stage_<i>.py
(the stage source that load imports), stage_<i>.pt (the stage's submodules and tensors under
their FQNs, and its optimizer state, all on the CPU), runtime.pt (optimizer factory, clipping,
which stages swap). The directory is written beside the target and renamed into place, so an
interrupted save never leaves a half-written checkpoint where a good one was.

Under torch.distributed each rank holds only its own stages. Every rank calls `save`; each
snapshots its stages (weights, optimizer state, generated source) to CPU memory and gathers
them to rank 0 (`gather_object`), which writes the whole checkpoint, in the same layout as a
single process, and renames it into place. Every rank returns only after that rename (or raises
the same failure), so no rank reads or overwrites a half-written checkpoint. The files are
written on rank 0's machine: across machines, load from a filesystem every rank shares (or
copy the directory to each machine) to `load` under torchrun; a single process loads it anywhere.
"""

from __future__ import annotations

import copy
import io
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from stagewise.codegen.source import load_stage, stage_source
from stagewise.ir.errors import PeerError, PlanError
from stagewise.ir.plan import Plan
from stagewise.runtime.distributed import POLL_S, Pending
from stagewise.runtime.launch import distributed_context


def save(pipe, directory) -> None:
    """Write `pipe` to `directory`, atomically; under torch.distributed every rank must call it."""
    if pipe.context is None:
        _write(
            pipe, Path(directory), (_snapshot(pipe, worker) for worker in pipe.workers)
        )  # one stage at a time
        return
    _save_distributed(pipe, Path(directory))


def load(directory):
    """A Pipeline from `pipe.save(directory)`; trains on from where it was saved.

    In one process it holds every stage. Under torch.distributed (torchrun, one process per
    device of the plan) each rank reads plan.json and only its own stages' files; the ranks
    agree that every one of them could read its part before any starts, so a rank that cannot
    see the directory is an error on every rank, not a hang.
    """
    from stagewise.compiler.pipeline import Pipeline

    root = Path(directory)
    context = distributed_context()
    if context is None:
        plan, runtime, saved, modules = _read(root, None)
    else:
        try:
            plan, runtime, saved, modules = _read(root, context.rank)
            failure = None
        except Exception as error:  # noqa: BLE001 - told to the other ranks, then re-raised
            failure = error
        messages = [None] * context.world_size
        dist.all_gather_object(messages, None if failure is None else f"{type(failure).__name__}: {failure}")
        if failure is not None:
            raise failure
        failed = [f"rank {r}: {m}" for r, m in enumerate(messages) if m is not None]
        if failed:
            raise PlanError(
                f"loading {root} failed on other ranks ({'; '.join(failed)}); every rank must see the "
                "checkpoint directory (across machines: a shared filesystem, or a copy on each)"
            )
    pipe = Pipeline(
        plan, modules, runtime["optimizer"], runtime["clip_grad_norm"], runtime.get("swapped", frozenset())
    )
    for worker in pipe.workers:
        state = saved[worker.stage.index]
        if worker.optimizer is not None and state["optimizer"] is not None:
            worker.optimizer.load_state_dict(state["optimizer"])
            if worker.swapped:
                _park_optimizer_state(worker)
    return pipe


# ---- saving -------------------------------------------------------------------------------------
def _save_distributed(pipe, target: Path) -> None:
    """Gather every rank's stages to rank 0, which writes them; everyone returns after the rename."""
    context, group = pipe.context, pipe.transport.world
    _meet(pipe, f"pipe.save({str(target)!r})")
    try:
        mine = [_snapshot(pipe, worker) for worker in pipe.workers]
        local_error = None
    except Exception as error:  # noqa: BLE001 - sent to rank 0 so that no rank waits for it
        mine, local_error = f"{type(error).__name__}: {error}", error
    parts = [None] * context.world_size if context.rank == 0 else None
    dist.gather_object(mine, parts, dst=0, group=group)
    outcome = [None]
    if context.rank == 0:
        failed = [f"rank {r}: {p}" for r, p in enumerate(parts) if isinstance(p, str)]
        if failed:
            outcome[0] = f"the checkpoint was not written: {'; '.join(failed)}"
        else:
            try:
                _write(pipe, target, (record for part in parts for record in part))
            except Exception as error:  # noqa: BLE001 - told to the other ranks, then re-raised
                local_error = local_error or error
                outcome[0] = f"rank 0 could not write {target} ({type(error).__name__}: {error})"
    dist.broadcast_object_list(outcome, src=0, group=group)  # the barrier: the rename is done (or failed)
    if local_error is not None:
        raise local_error
    if outcome[0] is not None:
        raise PlanError(
            f"pipe.save({str(target)!r}) failed, {outcome[0]}; any earlier checkpoint there is intact"
        )


def _meet(pipe, what: str) -> None:
    """Wait up to `pipe.timeout_s` for every rank to reach save; a rank that never does (a save
    called on rank 0 only) is a PeerError here, not a wait for the process group's timeout."""
    transport = pipe.transport
    work = transport.issue(lambda: dist.barrier(group=transport.world, async_op=True), what, "every rank")
    pending = Pending(work, transport.blocking_wait, what, "every rank")
    start = time.monotonic()
    while not pending.done(POLL_S):
        if time.monotonic() - start > transport.timeout_s:
            raise PeerError(
                f"{what}: waited {transport.timeout_s:g} s for the other ranks; under torch.distributed every "
                "rank must call pipe.save(directory) (each holds only its own stages), not only rank 0"
            )


def _snapshot(pipe, worker) -> dict:
    """One stage as the checkpoint holds it: its source, and its stage_<i>.pt already serialised
    here (so a rank that cannot serialise its stage says so instead of failing mid-collective):
    tensors and optimizer state on the CPU, host copies standing in for what a swapped stage
    keeps off the device between steps."""
    state = io.BytesIO()
    torch.save({"attrs": _cpu_attrs(worker), "optimizer": _optimizer_state(worker)}, state)
    return {
        "index": worker.stage.index,
        "source": stage_source(worker.module, _stage_doc(pipe, worker)),
        "state": state.getvalue(),
        "swapped": worker.swapped,
    }


def _write(pipe, target: Path, records) -> None:
    """Write the plan and the stage records into a staging directory beside `target`, then rename."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _put(staging / "plan.json", pipe.plan.to_json())
        _put(staging / "programs.txt", "\n\n".join(str(p) for p in pipe.plan.programs) + "\n")
        written, swapped = set(), set()
        for record in records:
            i = record["index"]
            _put(staging / f"stage_{i}.py", record["source"])
            _put(staging / f"stage_{i}.pt", record["state"])
            written.add(i)
            if record["swapped"]:
                swapped.add(i)
        missing = sorted({s.index for s in pipe.plan.stages} - written)
        if missing:
            raise PlanError(f"no rank held stages {missing}; the checkpoint would be incomplete")
        runtime = io.BytesIO()
        torch.save(
            {
                "optimizer": pipe.optimizer_factory,
                "clip_grad_norm": pipe.clip_grad_norm,
                "swapped": frozenset(swapped),
            },
            runtime,
        )
        _put(staging / "runtime.pt", runtime.getvalue())
        _sync_directory(staging)
        _replace(staging, target)
        _sync_directory(target.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _stage_doc(pipe, worker) -> str:
    stage = worker.stage
    layers = [pipe.plan.layers[j].name for j in stage.layers]
    return (
        f"Stage {stage.index} of {pipe.plan.model}, generated by stagewise.\n\n"
        f"Layers: {', '.join(layers)}.\nInputs: {', '.join(stage.inputs)}.\n"
        f"Outputs: {', '.join(stage.outputs)}.\n"
    )


def _cpu_attrs(worker) -> dict[str, object]:
    """`_attrs` of the stage, copied so that every tensor is a CPU tensor holding its real value.

    Tensors already on the CPU and in place are shared, not copied; the rest (device tensors,
    parameters of a swapped stage, which are empty on the device and live in `worker.host`) are
    copied once each, so tied tensors stay one tensor.
    """
    module = worker.module
    memo: dict[int, object] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in memo:
            continue
        value = param.detach()
        if value.numel() == 0 and ("weights", name) in worker.host:
            value = worker.host[("weights", name)]
        elif value.device.type == "cpu":
            memo[id(param)] = param
            continue
        memo[id(param)] = torch.nn.Parameter(value.to("cpu", copy=True), requires_grad=param.requires_grad)
    for tensor in [b for _, b in module.named_buffers(remove_duplicate=False)] + [
        v for v in _attrs(module).values() if isinstance(v, torch.Tensor)
    ]:
        if id(tensor) not in memo:
            memo[id(tensor)] = tensor if tensor.device.type == "cpu" else tensor.detach().to("cpu")
    return copy.deepcopy(_attrs(module), memo)


def _optimizer_state(worker) -> dict | None:
    """The stage optimizer's state_dict with CPU tensors; a swapped stage's state from host memory."""
    if worker.optimizer is None:
        return None
    state = worker.optimizer.state_dict()
    order = [p for group in worker.optimizer.param_groups for p in group["params"]]
    names = {id(p): n for n, p in worker.params.items()}
    tensors = {}
    for index, values in state["state"].items():
        name = names[id(order[index])]
        tensors[index] = {}
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                if value.numel() == 0 and ("optimizer", f"{name}.{key}") in worker.host:
                    value = worker.host[("optimizer", f"{name}.{key}")]
                value = value.detach().to("cpu")  # serialised at once: a CPU tensor needs no copy
            tensors[index][key] = value
    return {"state": tensors, "param_groups": copy.deepcopy(state["param_groups"])}


def _attrs(module: torch.nn.Module) -> dict[str, object]:
    """The objects the stage code reaches by FQN: leaf submodules and top-level tensors."""
    attrs = {}
    graph = module.graph
    for node in graph.nodes:
        if node.op == "call_module":
            attrs[node.target] = module.get_submodule(node.target)
        elif node.op == "get_attr":
            *path, leaf = node.target.split(".")
            owner = module.get_submodule(".".join(path)) if path else module
            attrs[node.target] = getattr(owner, leaf)
    return attrs


def _put(path: Path, data: str | bytes) -> None:
    """Write a file and flush it to the disk, so the rename never publishes data still in flight."""
    with open(path, "wb") as file:
        file.write(data.encode() if isinstance(data, str) else data)
        file.flush()
        os.fsync(file.fileno())


def _sync_directory(path: Path) -> None:
    """Make a directory's entries (the files in it, a rename into it) durable, where the OS allows."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _replace(staging: Path, target: Path) -> None:
    """Move the finished checkpoint into place; the old one is removed only after."""
    if target.exists():
        old = target.with_name(f".{target.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(target, old)
        os.replace(staging, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, target)


# ---- loading ------------------------------------------------------------------------------------
def _read(root: Path, rank: int | None):
    """plan, runtime options, saved stage state and stage modules; under torch.distributed only the
    stages of device `rank` (the others are None: the Pipeline keeps only this rank's stages)."""
    if not (root / "plan.json").exists():
        raise PlanError(f"{root} holds no stagewise checkpoint (plan.json is missing)")
    plan = Plan.from_json((root / "plan.json").read_text())
    runtime = torch.load(root / "runtime.pt", weights_only=False, map_location="cpu")
    saved, modules = {}, []
    for s in plan.stages:
        if rank is not None and s.device != rank:
            modules.append(None)
            continue
        saved[s.index] = torch.load(root / f"stage_{s.index}.pt", weights_only=False, map_location="cpu")
        modules.append(
            load_stage(str(root / f"stage_{s.index}.py"), f"Stage{s.index}", saved[s.index]["attrs"])
        )
    return plan, runtime, saved, modules


def _park_optimizer_state(worker) -> None:
    """A swapped stage keeps its optimizer state in host memory between steps, as after its update."""
    for name, tensor in worker.tensors("optimizer").items():
        host = tensor.detach().to("cpu", copy=True)
        worker.host[("optimizer", name)] = host.pin_memory() if worker.device.type == "cuda" else host
        worker._set("optimizer", name, torch.empty(0, dtype=tensor.dtype, device=worker.device))
