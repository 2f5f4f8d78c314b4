"""Stages from a partition: which values each stage takes in, gives out, and to whom.

A value used by a later stage is sent directly from the stage that makes it to every stage
that uses it (a skip connection from stage 0 to stage 3 is one transfer, not a relay
through 1 and 2); graph inputs (token ids, targets) are fed to each stage that reads them.
"""

from __future__ import annotations

import torch.fx as fx

from stagewise.ir.plan import Layer, Stage, Transfer
from stagewise.passes.cutpoints import value_info
from stagewise.passes.layers import COMPUTE_OPS, state_targets


def build_stages(
    gm: fx.GraphModule,
    layers: tuple[Layer, ...],
    starts: list[int],
    microbatch_size: int,
    n_devices: int | None = None,
    device_of: list[int] | None = None,
) -> tuple[tuple[Stage, ...], tuple[Transfer, ...]]:
    """`starts[s]` is the first layer of stage s; stage s runs on device_of[s] (default s mod n_devices)."""
    n_devices = n_devices or len(starts)
    device_of = device_of or [s % n_devices for s in range(len(starts))]
    bounds = list(starts) + [len(layers)]
    stage_of_layer = {i: s for s in range(len(starts)) for i in range(bounds[s], bounds[s + 1])}
    stage_of = {name: stage_of_layer[layer.index] for layer in layers for name in layer.nodes}
    info = value_info(gm, microbatch_size)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    loss = output.args[0]

    transfers = []
    for node in gm.graph.nodes:
        if node.op not in COMPUTE_OPS:
            continue
        src = stage_of[node.name]
        for dst in sorted({stage_of[u.name] for u in node.users if u.name in stage_of} - {src}):
            v, val = info[node.name], node.meta.get("val")
            shape = tuple(int(d) for d in val.shape) if hasattr(val, "shape") else ()
            dtype = str(val.dtype).removeprefix("torch.") if hasattr(val, "dtype") else "float32"
            transfers.append(Transfer(node.name, src, dst, v.bytes_per_sample, v.requires_grad, "direct", shape, dtype))

    param_names = {k for k, _ in gm.named_parameters(remove_duplicate=False)}
    nodes_of: dict[int, list[fx.Node]] = {s: [] for s in range(len(starts))}
    for n in gm.graph.nodes:
        if n.name in stage_of:
            nodes_of[stage_of[n.name]].append(n)
    stages = []
    for s in range(len(starts)):
        nodes = nodes_of[s]
        graph_inputs = [p.name for p in placeholders if any(stage_of.get(u.name) == s for u in p.users)]
        received = [t.value for t in transfers if t.dst == s]
        sent = list(dict.fromkeys(t.value for t in transfers if t.src == s))
        outputs = ([loss.name] if stage_of[loss.name] == s else []) + sent
        targets = state_targets(gm, nodes)
        stages.append(
            Stage(
                index=s,
                device=device_of[s],
                layers=tuple(range(bounds[s], bounds[s + 1])),
                inputs=tuple(graph_inputs + received),
                outputs=tuple(outputs),
                params=tuple(t for t in targets if t in param_names),
                buffers=tuple(t for t in targets if t not in param_names),
            )
        )
    return tuple(stages), tuple(transfers)
