"""The pipeline a user drives: `Pipeline` (step, evaluate, predict, state_dict, save, restore, resize)
and what its calls go through: inputs checked and split into microbatches, predictions put back in the
model's shape, the optimizer view, the training state, morphing onto another plan, virtual devices."""
