"""`sw.load`: a pipeline from a checkpoint (compiler/checkpoint/ holds the format), without the model class,
running nothing from it: the saved plan's stages rebuilt from data (compiler/checkpoint/reopen.py), or on
other devices the saved graph planned again (compiler/elastic/replan.py). It sits above the compiler,
since a re-plan compiles.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

from stagewise.compiler.assembly.fx_sources import releasing_fx_sources
from stagewise.compiler.assembly.loss_reduction import reduction_from_data
from stagewise.compiler.assembly.options import check_flags
from stagewise.compiler.assembly.shape_buckets import padding_from_data
from stagewise.compiler.assembly.tensor_parallel import check_tensor_parallel
from stagewise.compiler.checkpoint.arguments import checkpoint_path
from stagewise.compiler.checkpoint.arguments import trusted_functions as checked_trusted
from stagewise.compiler.checkpoint.read import Checkpoint, read_checkpoint, trusted_by_name
from stagewise.compiler.checkpoint.reopen import reopen
from stagewise.compiler.checkpoint.verify import rebuild_checkpoint
from stagewise.compiler.elastic.replan import replan as plan_again
from stagewise.compiler.pipeline.pipeline import Pipeline
from stagewise.compiler.pipeline.training_state import TrainingState, put_saved_mode
from stagewise.compiler.pipeline.virtual_devices import remapped
from stagewise.ir.devices import resolve_devices
from stagewise.ir.errors import OptionError
from stagewise.runtime.launch import distributed_context


@releasing_fx_sources
def load(directory, trusted_functions: Sequence[Callable] = (), devices=None, replan: bool | None = None,
         report: bool = True, tensor_parallel: int | None = None) -> Pipeline:
    """A Pipeline from `pipe.save(directory)`, trained on from where it was saved. `trusted_functions`:
    functions and classes of yours the checkpoint names but never holds (a `loss_fn`, an optimizer
    class, a torch function or op that stagewise's allowlist does not list, codegen/allowlist.py);
    what the allowlist lists is found by its exact name, anything else is refused before it runs.

    `devices`: by default the devices it was saved on, with the saved plan. Other devices get a new
    plan, made from the graph the checkpoint keeps, without the model (Varuna's job morphing,
    compiler/elastic/replan.py; what moved is printed unless not `report`), except for a plan compiled with
    `virtual_devices`, whose devices are placed on them as `pipe.resize` places them (bitwise the
    same training, compiler/pipeline/virtual_devices.py). `replan=True` / `False` asks for one or the other.
    `tensor_parallel`: the ranks each stage spans, by default the saved plan's; another T plans again
    (on the saved devices unless `devices` says), the saved whole tensors split anew
    (compiler/checkpoint/shards.py).

    In one process it holds every stage. Under torch.distributed (torchrun, one process per device
    of the plan) each rank builds every stage's code and reads only its own stages' state; the
    ranks agree that every one of them could read its part before any starts.

    Args:
        directory: a checkpoint `pipe.save` (or `sw.Checkpoints`) wrote.
        trusted_functions: your functions and classes the checkpoint may name.
        devices: where to run it; None for the devices it was saved on.
        replan: True to plan again for `devices`, False to place the saved plan on them; None
            decides as above.
        report: whether to print what moved when it plans again.
        tensor_parallel: the ranks each stage spans (T); None for the saved plan's.

    Returns:
        The `Pipeline`, with its weights, optimizer state, step count, mode and `extra`.

    Raises:
        CheckpointError: the folder is missing, damaged or altered (every file is checked).
        UntrustedCodeError: it names code neither the allowlist nor `trusted_functions` holds.
        OptionError: `replan=True` without devices, or a flag that is not a bool.
        CapacityError: the devices given cannot hold it.

    Example:
        >>> _ = pipe.save(tmp / "to_load")
        >>> loaded = sw.load(tmp / "to_load")
        >>> loaded.plan == pipe.plan, torch.equal(loaded.predict(x), pipe.predict(x))
        (True, True)
    """
    check_flags(report=report)
    if replan is not None:  # None: plan again only for other devices
        check_flags(replan=replan)
    if tensor_parallel is not None:
        check_tensor_parallel(tensor_parallel)
    directory, trusted_functions = checkpoint_path(directory, "sw.load"), checked_trusted(trusted_functions)
    context = distributed_context()
    saved = read_checkpoint(directory, context)
    trusted = trusted_by_name(trusted_functions)
    rebuilt = rebuild_checkpoint(saved, trusted)  # every name resolved before anything runs
    degree = tensor_parallel or saved.plan.rank_layout().degree
    if _replans(saved, devices, replan, degree):
        return plan_again(saved, rebuilt.graph, devices or [d.name for d in saved.plan.devices], trusted, report,
                          degree)
    plan = saved.plan if devices is None else remapped(saved.plan, devices)
    runtime, unheld = reopen(saved, rebuilt.stages, plan, trusted, context)
    training = saved.training
    pipe = Pipeline(plan, runtime, unheld=unheld)
    pipe._resumed = TrainingState.from_settings(training)
    pipe.loss_reduction = reduction_from_data(training.get("loss_reduction"))  # checked against the plan
    pipe._feeding.padding = padding_from_data(training.get("padding"))  # compile's shape_buckets, checked
    put_saved_mode(pipe, training)
    pipe._model_graph = saved.model_graph  # its next checkpoint can be planned again as well
    return pipe


def _replans(saved: Checkpoint, devices, replan: bool | None, degree: int) -> bool:
    """Whether `load` plans again for `devices` with `degree` ranks per stage (its docstring): asked,
    another T, or other devices than the saved plan's and a plan not made for virtual devices."""
    other_degree = degree != saved.plan.rank_layout().degree
    if other_degree and replan is False:
        raise OptionError(f"sw.load(..., tensor_parallel={degree}, replan=False): the saved plan spans "
                          f"{saved.plan.rank_layout().degree} rank(s) per stage; another T needs a new plan: drop "
                          "replan=False")
    if replan is not None:
        if replan and devices is None:
            raise OptionError("sw.load(..., replan=True) plans for other devices: give them, devices=[...]")
        return replan
    if other_degree:
        return True
    if devices is None:
        return False
    given = resolve_devices(devices)
    if [d.spec() for d in given] == list(saved.plan.devices):
        return False
    graph = saved.model_graph or {}
    if graph.get("options", {}).get("virtual_devices") is not None:
        return False
    if "graph" not in graph:
        warnings.warn(f"{saved.root} keeps no graph to plan again from ({graph.get('unavailable', 'saved before')}"
                      f"): its plan's {len(saved.plan.devices)} devices are placed on the {len(given)} given; "
                      "for a plan made for them, compile the model and call pipe.restore(directory)", stacklevel=3)
        return False
    return True

