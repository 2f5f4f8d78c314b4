"""Where `compile_stages=True` and `cuda_graphs=True` cannot apply, refused before anything runs
(runtime/stage_calls.py runs them).

A CUDA graph replays the kernels it captured on the memory it captured them with, and the random
seeds they were launched with, so it is refused where any of these would change between steps:
a CPU device (no graphs), state or stashes moved between host and device memory (other memory),
a keyed random op (its stream is seeded on the host per step and microbatch: a replay would draw
the captured step's mask again). Both options at once are refused: a capture of inductor's code
is torch.compile's own mode="reduce-overhead", which this pipeline does not drive.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
import torch.fx as fx

from stagewise.ir.devices import Device
from stagewise.ir.errors import OptionError
from stagewise.ir.instructions import InputGrad, Stream
from stagewise.ir.plan import Plan
from stagewise.ir.random_streams import keyed, keyed_dropout
from stagewise.runtime.stage_calls import EAGER, Acceleration

_MOVES = (Stream.SWAP_IN, Stream.SWAP_OUT)  # swaps, stash moves and the host optimizer's step


def check_devices(acceleration: Acceleration, devices: Sequence[Device]) -> None:
    """Before compiling: one of the two at a time, and CUDA graphs on CUDA devices only."""
    if acceleration.compile_stages and acceleration.cuda_graphs:
        raise OptionError("compile_stages=True and cuda_graphs=True were both given; give one: compile_stages for "
                          "inductor's fused kernels, cuda_graphs to replay the eager kernels without launch cost")
    check_cuda_graphs(acceleration, [(d.name, d.torch_device) for d in devices],
                "; give CUDA devices only, or drop cuda_graphs (compile_stages=True speeds up CPU stages)")


def loaded_acceleration(saved: dict | None, plan: Plan, modules: Sequence[fx.GraphModule | None]) -> Acceleration:
    """A checkpoint's compile_stages / cuda_graphs (training.pt, checked) for the plan it is loaded with:
    kept where they still apply (a loaded pipeline ran its stages eagerly before, however it was
    compiled); where they do not (CUDA graphs loaded onto CPU devices), eagerly, said in a warning."""
    if saved is None:
        return EAGER
    acceleration = Acceleration(**saved)
    try:
        check_cuda_graphs(acceleration, [(device.name, torch.device(device.name)) for device in plan.devices])
        check_plan(acceleration, plan, modules)
    except OptionError as error:
        warnings.warn(f"the checkpoint's stages ran with {acceleration}; they run eagerly here: {error}",
                      stacklevel=4)
        return EAGER
    return acceleration


def check_cuda_graphs(acceleration: Acceleration, devices: Sequence[tuple[str, torch.device]], fix: str = "") -> None:
    """CUDA graphs on CUDA devices only (`devices`: each one's name and torch device; the given devices
    before compiling, a plan's on load); `fix` ends the refusal."""
    other = next((name for name, device in devices if device.type != "cuda"), None)
    if acceleration.cuda_graphs and other is not None:
        raise OptionError(f"cuda_graphs=True captures CUDA graphs, and device {other!r} is not a CUDA device{fix}")


def check_plan(acceleration: Acceleration, plan: Plan, modules: Sequence[fx.GraphModule | None]) -> None:
    """After planning: neither option with a split backward (a compiled backward frees its buffers, a
    graph replays it whole); a graphed plan moves no state or stash, and its stages draw no keyed
    random numbers."""
    split = next((ins for program in plan.programs for ins in program.instructions if isinstance(ins, InputGrad)), None)
    if split is not None and (acceleration.cuda_graphs or acceleration.compile_stages):
        option, does = ("cuda_graphs", "replays") if acceleration.cuda_graphs else ("compile_stages", "compiles")
        raise OptionError(f"{option}=True {does} each stage's backward as one piece, and this plan splits stage "
                          f"{split.stage}'s into input and weight gradients ({split}, schedule {plan.schedule}); give "
                          f"another schedule, or drop {option}")
    if not acceleration.cuda_graphs:
        return
    moved = next((ins for program in plan.programs for ins in program.instructions
                  if ins.stream in _MOVES), None)
    if moved is not None:
        raise OptionError(f"cuda_graphs=True replays kernels on the memory they were captured with, and this plan "
                          f"moves stage {moved.stage}'s state or stash between host and device memory ({moved}); "
                          "give swap='off' and optimizer_on_host=False (or devices with the memory), or drop "
                          "cuda_graphs")
    for stage, module in enumerate(modules):
        drawn = next((n for n in module.graph.nodes if n.op == "call_function" and n.target in (keyed, keyed_dropout)),
                     None) if module is not None else None
        if drawn is not None:
            raise OptionError(f"cuda_graphs=True would replay stage {stage}'s random op {drawn.name!r} with the mask "
                              "of the step it was captured in (its stream is seeded per step and microbatch); set "
                              "the model's dropout to p=0, or drop cuda_graphs")
