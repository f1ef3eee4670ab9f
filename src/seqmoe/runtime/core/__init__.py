"""What every engine of the runtime shares: the expert pool and its slot table, the copy worker,
the controller that drives the memory manager, the experts module swapped into the model, the
device checks and undo log of `offload`, the cost table measured at start, and Ctrl-C safety.

A decode step told end to end, with the file and function of each stage: docs/decode.md.
"""
