"""Checkpoints and elastic training above the pipeline and the compiler: `sw.load` (load.py), planning a
saved graph again for other devices (replan.py, Varuna's job morphing) and periodic checkpoints that
survive preemption (periodic.py)."""
