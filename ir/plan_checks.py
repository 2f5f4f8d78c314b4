"""A plan read from a file (plan.json) checked before anything uses its numbers.

Why: a checkpoint is untrusted input and plan.json's numbers drive what loading allocates and
loops over: the re-plan's example batch is microbatches × microbatch size × each input's
shape (compiler/elastic/replan.py), a receiver's buffer is a transfer's shape, and message tags,
programs and stage placement index by counts and device numbers. A crafted plan.json with a
negative, absurd or mistyped number is refused here, naming the entry, instead of a raw error,
a hang or a huge allocation. The sizes are bounded by fixed limits far above any real plan
(an attacker controls every number the checkpoint holds, so none of them can bound another).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from stagewise.ir.choices import ActivationPolicy
from stagewise.ir.declared import ALTERED, dtype_named, plain_shape
from stagewise.ir.errors import CheckpointError
from stagewise.ir.instructions import Recompute, StashIn, StashOut
from stagewise.ir.output_spec_check import check_output_spec

if TYPE_CHECKING:
    from collections.abc import Iterable

    from stagewise.ir.plan import InputSpec, Plan
    from stagewise.ir.program import Program
    from stagewise.ir.tensor_parallel import TensorParallel

MAX_COUNT = 1 << 16  # devices, stages, microbatches: far above any pipeline
MAX_MICROBATCH_SIZE = 1 << 24  # samples in one microbatch
MAX_DECLARED_BYTES = 4 << 30  # the example batch a re-plan builds; one message a receiver allocates
_WHERE = "plan.json"


def check_plan(plan: Plan) -> Plan:
    """`plan` once every count, index, shape and dtype it declares is possible (module docstring)."""
    _count("microbatches", plan.microbatches, 1, MAX_COUNT)
    _count("microbatch_size", plan.microbatch_size, 1, MAX_MICROBATCH_SIZE)
    _count("smallest_microbatch", plan.smallest_microbatch, 0, plan.microbatch_size)
    _count("the number of devices", len(plan.devices), 1, MAX_COUNT)
    _count("the number of stages", len(plan.stages), 1, MAX_COUNT)
    if plan.input_kind not in ("positional", "keyword"):
        _refuse("input_kind", plan.input_kind, "'positional' or 'keyword'")
    if plan.tensor_parallel is not None:
        _check_tensor_parallel(plan.tensor_parallel, len(plan.layers))
        _check_split_shapes(plan.tensor_parallel, dict(zip(plan.state_names, plan.state_shapes, strict=False)))
    for position, stage in enumerate(plan.stages):
        name = f"stages[{position}]"
        _count(f"{name}.index", stage.index, position, position)
        _count(f"{name}.device", stage.device, 0, len(plan.devices) - 1)
        for microbatch in stage.microbatches:
            _count(f"{name}.microbatches", microbatch, 0, plan.microbatches - 1)
    for position, transfer in enumerate(plan.transfers):
        name = f"transfers[{position}] ({transfer.value!r})"
        _count(f"{name}.src", transfer.src, 0, len(plan.stages) - 1)
        _count(f"{name}.dst", transfer.dst, 0, len(plan.stages) - 1)
        dtype = dtype_named(transfer.dtype, f"{_WHERE} {name}")
        _bounded(name, math.prod(_shape(f"{name}.shape", transfer.shape)) * dtype.itemsize, "one microbatch's message")
    example = 0
    for position, spec in enumerate(plan.input_specs):
        example += _spec_bytes(f"input_specs[{position}]", spec, plan.microbatches * plan.microbatch_size)
    _bounded("input_specs", example, "the example batch a re-plan builds (microbatches × microbatch_size "
             "× each input's shape)")
    for position, shape in enumerate(plan.state_shapes):
        _shape(f"state_shapes[{position}]", shape)
    _check_programs(plan)
    _check_split(plan)
    _check_activations(plan)
    check_output_spec(plan.output_spec)
    if not all(name is None or isinstance(name, str) for name in plan.output_nodes):
        _refuse("output_nodes", plan.output_nodes, "a node name or null per leaf of output_spec")
    return plan


def _check_programs(plan: Plan) -> None:
    """Every program on a device of the plan, its instructions naming stages, devices and
    microbatches the plan has (the runtime indexes by them), a swap or stash at most
    MAX_DECLARED_BYTES."""
    highest = {"stage": len(plan.stages) - 1, "peer_stage": len(plan.stages) - 1, "peer": len(plan.devices) - 1,
               "microbatch": plan.microbatches - 1, "nbytes": MAX_DECLARED_BYTES}
    for position, program in enumerate(plan.programs):
        _count(f"programs[{position}].device", program.device, 0, len(plan.devices) - 1)
        for index, instruction in enumerate(program.instructions):
            for name, high in highest.items():
                if hasattr(instruction, name):
                    _count(f"programs[{position}] instruction {index} ({instruction}): {name}",
                           getattr(instruction, name), 0, high)


def _check_split(plan: Plan) -> None:
    """The predicted split on a device of the plan, each part a finite, non-negative number of seconds
    (the table divides and formats them)."""
    split = plan.predicted_split
    if split is None:  # a plan made by hand, or saved before the split was kept
        return
    _count("predicted_split.device", split.device, 0, len(plan.devices) - 1)
    for label, seconds in split.parts():
        if type(seconds) not in (int, float) or not 0 <= seconds < math.inf:
            _refuse(f"predicted_split's {label} seconds", seconds, "a finite, non-negative number of seconds")


def activations_run(programs: Iterable[Program]) -> dict[int, ActivationPolicy]:
    """Per stage, what its programs do with its stashes: recompute them, swap them to host memory, else
    (a stage not listed) keep them. A plan saved before stages recorded a policy reads as this."""
    run: dict[int, ActivationPolicy] = {}
    for program in programs:
        for instruction in program.instructions:
            if isinstance(instruction, Recompute):
                run[instruction.stage] = ActivationPolicy.RECOMPUTE
            elif isinstance(instruction, StashOut | StashIn) and instruction.stage not in run:
                run[instruction.stage] = ActivationPolicy.SWAP
    return run


def _check_activations(plan: Plan) -> None:
    """Each stage's recorded policy is one a stage runs (not AUTO) and the one its programs run (a
    SWAP stage may keep every stash: one whose backward comes right after its forward stays), so the
    plan table never says keep where a stage recomputes."""
    run = activations_run(plan.programs)
    for stage in plan.stages:
        recorded, does = stage.activations, run.get(stage.index, ActivationPolicy.KEEP)
        agrees = not plan.programs or recorded == does or (recorded, does) == (ActivationPolicy.SWAP,
                                                                                 ActivationPolicy.KEEP)
        if recorded is ActivationPolicy.AUTO or not agrees:
            _refuse(f"stages[{stage.index}].activations", str(recorded),
                    f"the policy its programs run ('{does}')")


def _spec_bytes(name: str, spec: InputSpec, batch: int) -> int:
    """The bytes of an input's example (`batch` samples where it is batched), its sizes checked."""
    shape = _shape(f"{name}.shape", spec.shape)
    lowest = _shape(f"{name}.lowest", spec.lowest)
    if lowest and (len(lowest) != len(shape) or any(low > size for low, size in zip(lowest, shape, strict=True))):
        _refuse(f"{name}.lowest", spec.lowest, f"a size no larger than each of the shape's {shape}")
    dtype = dtype_named(spec.dtype, f"{_WHERE} {name}")
    return math.prod(shape) * (batch if spec.batched is True else 1) * dtype.itemsize


def _bounded(name: str, size: int, what: str) -> None:
    """A CheckpointError where `size` bytes of `what` exceed MAX_DECLARED_BYTES."""
    if size > MAX_DECLARED_BYTES:
        raise CheckpointError(f"{_WHERE} declares {name} as {size} bytes for {what}, above the "
                              f"{MAX_DECLARED_BYTES >> 30} GiB stagewise allocates for it from a checkpoint; {ALTERED} "
                              "(a real plan this large: compile the model and call pipe.restore(directory))")


def _shape(name: str, value: object) -> tuple[int, ...]:
    shape = plain_shape(value)
    if shape is None:
        _refuse(name, value, "a shape: at most 64 non-negative ints")
    assert shape is not None
    return shape


def _count(name: str, value: object, low: int, high: int) -> None:
    if type(value) is not int or not low <= value <= high:
        _refuse(name, value, f"an int from {low} to {high}")


def _check_tensor_parallel(parallel: TensorParallel, layers: int) -> None:
    """Ranks, layers, dims and sizes in range: what a stage's code would be cut and sliced by."""
    _count("tensor_parallel.degree", parallel.degree, 2, MAX_COUNT)
    for position, block in enumerate(parallel.blocks):
        name = f"tensor_parallel.blocks[{position}]"
        _count(f"{name}.layer", block.layer, 0, layers - 1)
        for parameter in block.parameters:
            _count(f"{name} {parameter.name!r} dim", parameter.dim, 0, 1)
            _count(f"{name} {parameter.name!r} groups", parameter.groups, 1, MAX_COUNT)
        for edit in block.edits:
            _count(f"{name} size of {edit.node!r}", edit.value, 1, MAX_MICROBATCH_SIZE)


def _check_split_shapes(parallel: TensorParallel, shapes: dict[str, tuple[int, ...]]) -> None:
    """Each split parameter is one of the model's, whose shape splits over the ranks as recorded
    (its dim divides by groups x degree): else a stage would be cut from sizes no weight has."""
    for name, parameter in parallel.sharded().items():
        shape = shapes.get(name)
        if shapes and shape is None:
            _refuse(f"tensor_parallel's split parameter {name!r}", name, "a parameter of the model's state_dict")
        if shape is not None and parameter.part_shape(tuple(shape), parallel.degree) is None:
            _refuse(f"tensor_parallel's split of {name!r} (shape {tuple(shape)})",
                    {"dim": parameter.dim, "groups": parameter.groups, "degree": parallel.degree},
                    "a dim whose size divides by groups x degree")


def _refuse(name: str, value: object, expected: str) -> None:
    raise CheckpointError(f"{_WHERE} gives {name} as {repr(value)[:80]}, where a plan holds {expected}; {ALTERED}")
