"""`compile`, `plan` and `simulate`: the driver (driver.py) runs the phases (phases.py) over the traced
graph: analysis, measured devices and links (calibrate, cluster), costing, planning, and the graph kept
for a later re-plan (model_graph). It returns a `Pipeline` (compiler/pipeline/)."""
