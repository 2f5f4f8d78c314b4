"""The shared test harness: helpers more than one test file uses, so no test file imports another.

ranks: spawning gloo ranks, running a matrix of cases on them, reading what each saved.
rank_problems: the small problems the ranks and the parent build alike (tests/test_distributed.py's).
async_save: an asynchronous save held back deterministically, in one process and on two ranks.
checkpoints: a pipeline's optimizer state by name, and crafted copies of a saved checkpoint.
measured: the sizes and seconds a step measured, as the simulator's costs.
any_shape: batches of varying shape and eager training over the pipeline's uneven split.
precision: eager torch.autocast training, the reference for mixed precision.
cuda: training on the GPU against eager training on the GPU.
stages: hand-made stages for the simulator and schedules.
slow: the test files marked slow (tests/conftest.py), which the quick loop leaves out.

tests/reference.py (eager reference training), tests/hf.py (small Hugging Face configs),
tests/training_problems.py and tests/models/ are shared the same way. tests/test_harness.py fails
if a test file imports another test file.
"""
