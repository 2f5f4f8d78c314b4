"""Which microbatch sizes to probe: the largest that fits (Harmony §4.2's slow start), then a few up to it.

Profiling every microbatch size is too slow, so the profiler first finds the largest
microbatch that does not run out of memory, the way TCP's slow start finds a window, and then
probes about N_PROBES sizes up to that maximum (Srifty: four). A size "does not fit" when one
layer run alone (parameters, buffers, gradients, input, stash, output, workspace) needs more
than the capacity.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from stagewise.ir.devices import Device
from stagewise.ir.errors import ProfileError
from stagewise.ir.plan import Layer
from stagewise.passes.profile_layer import LayerState
from stagewise.passes.profile_shapes import ShapeCache, Shapes

N_PROBES = 4  # Srifty §5: four probed sizes were enough for 4.5-6.4% error
MAX_MICROBATCH = 4096  # the slow-start search stops here when memory never runs out


def probe_list(requested: Sequence[int] | None, top: int, largest: int | None, shapes: ShapeCache) -> list[int]:
    """The sizes to run: requested or spread over 1..top, within the largest that fits, and
    only sizes the graph can run at (a static-shape graph: its traced size alone)."""
    sizes = sorted({int(u) for u in requested}) if requested else list(probe_sizes(top))
    if any(u < 1 for u in sizes):
        raise ProfileError(f"microbatch sizes must be positive, got {sizes}")
    fitting = [u for u in sizes if largest is None or u <= largest] or ([largest] if largest is not None else [])
    runnable = [u for u in fitting if shapes.at(u).exact]
    return runnable or [shapes.traced]


def probe_sizes(top: int, n: int = N_PROBES) -> tuple[int, ...]:
    """About n sizes spread geometrically over 1..top, both ends included (Harmony: 'from 1 to
    this max size'; Srifty: four probes)."""
    if top <= 1:
        return (1,)
    return tuple(sorted({round(top ** (k / (n - 1))) for k in range(n)}))


def slow_start(fits: Callable[[int], bool], limit: int = MAX_MICROBATCH) -> int:
    """The largest u in 1..limit with fits(u) (fits must be monotone); 0 if not even 1 fits.

    Multiplicative increase until the first OOM, back to the last size that fit, then additive
    increase whose step halves at each further OOM, which ends on the exact largest size.
    """
    if not fits(1):
        return 0
    u = 1
    while u < limit and fits(min(2 * u, limit)):
        u = min(2 * u, limit)
    if u == limit:
        return u
    oom = min(2 * u, limit)  # the smallest size known not to fit
    step = max(u // 2, 1)
    while step >= 1:
        if u + step < oom and fits(u + step):
            u += step
        else:
            oom = min(oom, u + step)
            step //= 2
    return u


def fits(shapes: Shapes, state: Sequence[LayerState], capacity: int) -> bool:
    """Every layer, run alone at these shapes, needs at most `capacity` bytes."""
    return max(_layer_need(shapes, state, i) for i in range(len(state))) <= capacity


def _layer_need(shapes: Shapes, state: Sequence[LayerState], i: int) -> int:
    """Bytes one layer needs to run forward and backward on its own (Harmony's profiler runs each
    layer alone): its parameters, buffers and gradients, input, stash, output and workspace.
    The optimizer state is left out: Harmony updates it on the host."""
    s = state[i]
    return (s.param + s.grad + s.buffers + shapes.input_bytes[i] + shapes.stash_bytes[i]
            + shapes.act_bytes[i] + shapes.largest_bytes[i])


def does_not_fit(shapes: Shapes, state: Sequence[LayerState], layers: Sequence[Layer], capacity: int,
                 device: Device) -> ProfileError:
    """The error for a model one of whose layers needs more than `capacity` even at size 1."""
    need = [_layer_need(shapes, state, i) for i in range(len(layers))]
    worst = int(np.argmax(need))
    return ProfileError(
        f"layer {layers[worst].name!r} needs {need[worst]:,} bytes at microbatch size 1, more than the "
        f"{capacity:,} bytes of device {device.name!r}: give the device more memory "
        f"(sw.Device(..., memory=)) or split the module into smaller ones"
    )
