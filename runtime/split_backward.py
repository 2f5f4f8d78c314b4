"""A stage's backward in two halves (zero bubble's B and W, Qi et al. §2) with one backward's gradients.

B asks autograd for the gradient of the stage's inputs only (`torch.autograd.grad`, keeping the
graph): autograd then skips every branch that leads to weights alone. Prehooks on the *frontier*
(the nodes B runs that also lead to a weight: a Linear's addmm, a LayerNorm) record the gradient
flowing into each. W runs autograd again from the frontier (`torch.autograd.graph.GradientEdge`)
to the weights, one group of weights at a time (those reached through the same frontier nodes), so
the branches B skipped run once and what B ran does not run again (but where a frontier node lies
below another of its group, or an output depends on no input: W then runs through some of B's
nodes again, each frontier node's gradient clamped to what B recorded). Each node computes what it
computes in one backward, from the same incoming gradient, so each weight's gradient is one
backward's bit for bit, added to `.grad` as autograd's accumulation adds it, a copy of its own the
first time (tests/test_zero_bubble.py checks odd graphs, and training against 1F1B and eager).

This is torch.distributed.pipelining's `stage_backward_input` / `stage_backward_weight` (a private
module) over torch's public autograd graph API, with the case it leaves out: outputs that do not
depend on a stage input (every output of the first stage, whose inputs take no gradient). Their
weights are reached from those outputs in W, with every weight and frontier node in one call.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


@dataclass(eq=False)  # identity: groups are merged and removed by identity
class _Group:
    """Weights whose gradients flow only through `frontier` (and `roots`); what B recorded there."""

    weights: list[torch.Tensor]
    frontier: list[Node]
    recorded: dict[Node, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)
    roots: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # outputs B did not reach


@dataclass
class WeightPass:
    """What a microbatch's W needs after its B: each group's frontier gradients (the autograd graph
    they lead into stays alive with them)."""

    groups: list[_Group]

    def held_bytes(self) -> int:
        """The bytes of the gradients B recorded for W (the stash they lead into is counted apart)."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for group in self.groups for grads in group.recorded.values() for t in grads if t is not None}
        return sum(storages.values())

    def run(self) -> None:
        """Accumulate each weight's gradient into `.grad`, as one backward would."""
        for group in self.groups:
            _weight_grads(group)
        self.groups = []


def input_grads(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                weights: Iterable[torch.Tensor]) -> tuple[list[torch.Tensor | None], WeightPass]:
    """B: the gradient of each of `inputs` (None where none flows), and what W needs for `weights`."""
    if not outputs:
        return [None] * len(inputs), WeightPass([])
    roots = [get_gradient_edge(t).node for t in outputs]
    consumers, rank = _consumers(roots)
    closure, _ = _upward([get_gradient_edge(t).node for t in inputs], consumers, set())
    trainable = [w for w in weights if w.requires_grad]
    groups = _groups(trainable, consumers, closure, rank)
    unreached = [(t, g) for t, g, node in zip(outputs, grads, roots, strict=True) if node not in closure]
    if unreached:  # one call reaches every weight, through those outputs too
        frontier = sorted({n for g in groups for n in g.frontier}, key=rank.__getitem__)
        groups = [_Group(trainable, frontier, roots=unreached)]
    handles = [node.register_prehook(_recorder(group, node)) for group in groups for node in group.frontier]
    try:
        found: list[torch.Tensor | None] = list(
            torch.autograd.grad(outputs, inputs, grads, retain_graph=True, allow_unused=True)) if inputs else []
    finally:
        for handle in handles:
            handle.remove()
    return found, WeightPass(groups)


def _recorder(group: _Group, node: Node):
    def record(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        group.recorded[node] = grad_outputs
    return record


def _weight_grads(group: _Group) -> None:
    """W of one group: autograd from its frontier (and unreached outputs) to its weights."""
    if any(node not in group.recorded for node in group.frontier):  # B runs every node that leads to an input
        raise RuntimeError("a weight gradient's frontier node did not run in its input gradient's pass")
    edges, seeds = [], []
    for node in group.frontier:
        for i, grad in enumerate(group.recorded.get(node, ())):
            if grad is not None:
                edges.append(GradientEdge(node, i))
                seeds.append(grad)
    tensors = [*edges, *(get_gradient_edge(t) for t, _ in group.roots)]
    seeds += [g for _, g in group.roots]
    if not tensors or not group.weights:
        return
    # a frontier node below another of the group takes what B recorded, not that plus what flows in again
    clamps = [node.register_prehook(lambda _, kept=group.recorded[node]: kept)
              for node in group.frontier if node in group.recorded] if len(tensors) > 1 else []
    try:
        # the graph is kept: another group may run through a node this one runs (a weight also used
        # further down); it goes with the pass, once W is done
        found = torch.autograd.grad(tensors, [get_gradient_edge(w) for w in group.weights], seeds,
                                    retain_graph=True, allow_unused=True)
    finally:
        for clamp in clamps:
            clamp.remove()
    with torch.no_grad():
        for weight, grad in zip(group.weights, found, strict=True):
            if grad is None:
                continue
            if weight.grad is None:  # a copy of its own in the weight's layout, as autograd's accumulation
                weight.grad = torch.empty_like(weight).copy_(grad)  # makes one: autograd may hand one
            else:                                                   # tensor to several weights (x + a + b)
                weight.grad += grad


def _consumers(roots: list[Node]) -> tuple[dict[Node, list[Node]], dict[Node, int]]:
    """Each node of the graph below `roots` with the nodes that consume its outputs (reverse edges),
    and each node's rank in a breadth-first walk (the same every step: groups and calls keep one order)."""
    consumers: dict[Node, list[Node]] = defaultdict(list)
    rank = {node: i for i, node in enumerate(dict.fromkeys(roots))}
    queue = deque(rank)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            consumers[child].append(node)
            if child not in rank:
                rank[child] = len(rank)
                queue.append(child)
    return consumers, rank


def _upward(starts: Iterable[Node], consumers: dict[Node, list[Node]], stop: set[Node]) -> tuple[set[Node], set[Node]]:
    """The nodes reached from `starts` towards the outputs without passing a node of `stop`, and the
    nodes of `stop` met on the way."""
    reached, met = set(starts), set()
    queue = deque(reached)
    while queue:
        for node in consumers.get(queue.popleft(), ()):
            if node in stop:
                met.add(node)
            elif node not in reached:
                reached.add(node)
                queue.append(node)
    return reached, met


def _groups(weights: list[torch.Tensor], consumers: dict[Node, list[Node]], closure: set[Node],
            rank: dict[Node, int]) -> list[_Group]:
    """Weights grouped by the frontier nodes their gradients flow through (groups sharing one merged),
    in the weights' order."""
    groups: list[_Group] = []
    owner: dict[Node, _Group] = {}
    for weight in weights:
        _, frontier = _upward([get_gradient_edge(weight).node], consumers, closure)
        joined = {id(owner[n]): owner[n] for n in frontier if n in owner}
        group = _Group([weight], sorted(frontier, key=rank.__getitem__))
        for other in joined.values():
            group.weights = other.weights + group.weights
            group.frontier = sorted(set(other.frontier) | set(group.frontier), key=rank.__getitem__)
            groups.remove(other)
        for node in group.frontier:
            owner[node] = group
        if group.frontier:
            groups.append(group)
    return groups

