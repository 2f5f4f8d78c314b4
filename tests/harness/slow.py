"""Which test files are slow: the marker `slow` that `scripts/test.sh --quick` leaves out, and the
order the full suite hands files to its workers in."""

# Test files whose tests take over 10 s in all on a 2-core machine (pytest --durations=0 under -n 2),
# longest first: spawned gloo ranks and torchrun, memory-flatness loops, the Hugging Face and schedule
# matrices. Handing the longest out first keeps one long file from running alone at the end.
SLOW_FILES_LONGEST_FIRST = (
    "test_distributed.py", "test_frozen_shared.py", "test_differential.py", "test_distributed_training_api.py",
    "test_distributed_faults.py", "test_tensor_pipeline.py", "test_swap.py", "test_randomness.py", "test_replicated_stages.py",
    "test_no_leak.py", "test_evaluate.py", "test_equality.py", "test_planner.py", "test_precision.py",
    "test_inplace.py", "test_huggingface.py", "test_cli.py", "test_trainable_gradients.py",
    "test_harmony_search.py", "test_schedules.py", "test_loss_reduction.py", "test_opportunistic.py",
    "test_host_optimizer.py", "test_elastic.py", "test_two_hosts.py", "test_any_shape_distributed.py", "test_save_load.py",
    "test_activation_swap.py", "test_morph.py", "test_distributed_save.py", "test_recommend.py",
    "test_plan_only.py", "test_any_shape.py", "test_doc_examples.py", "test_finetune_example.py", "test_optimizer_api.py",
    "test_compiled_stages.py",
    "test_costs.py", "test_graph_data.py", "test_resume.py", "test_plan_and_code.py",
)
SLOW_FILES = frozenset(SLOW_FILES_LONGEST_FIRST)


def longest_first(file_name: str) -> int:
    """A sort key: slow files by their measured length, then every other file (a stable sort keeps their order)."""
    return SLOW_FILES_LONGEST_FIRST.index(file_name) if file_name in SLOW_FILES else len(SLOW_FILES_LONGEST_FIRST)
