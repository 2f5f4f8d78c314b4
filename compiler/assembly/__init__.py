"""What a running pipeline is assembled from: the checked options, the batch dimension, the optimizer
recipe and its parameter groups, the state names, the loss reduction and the runtime started from a plan.
Every other compiler package builds on these; they import none of them."""
