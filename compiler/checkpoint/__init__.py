"""The checkpoint on disk: what `pipe.save` writes (write, state, swap, async_save), how it is read back
as untrusted input (paths, limits, read, verify, dcp, files) and a runtime started from it (reopen,
restore). It sits below the pipeline, which saves through it; `sw.load` is compiler/elastic/.

Layout: plan.json (the whole IR, programs included), programs.txt and stage_<i>.py (to read:
the generated stage code, never run on load), stage_<i>.json (each stage module as data:
codegen/graph_data.py), weights/ (a torch.distributed.checkpoint of the weights under the
model's names, the optimizer state by parameter name and the stage code's other tensors:
compiler/checkpoint/dcp.py), graph.json (the whole graph compile planned, as data, to plan
again for other devices: compiler/compile/model_graph.py), training.pt (step, optimizer class and groups, clipping, which
stages swap, scheduler state, the user's metadata; read with weights_only=True), stagewise.json
(the marker: format version, size and SHA-256 of every other file; load checks each file it
reads against it). Save never replaces anything but a stagewise checkpoint, and a crash at any
moment leaves the old or the new one loadable at the path (compiler/checkpoint/swap.py).

Under torch.distributed every rank writes its own stages' weights into the one DCP folder, so a
checkpoint across machines needs a filesystem they share (compiler/checkpoint/write.py). A
checkpoint is read back by `sw.load` (the saved plan, rebuilt from data, or on other devices its
graph planned again: compiler/elastic/replan.py) or, into a pipeline compiled again on other devices, by
`pipe.restore` (compiler/checkpoint/restore.py).
"""
