"""Deciding how to decode on this machine: the block size and tree budget a drafter's acceptance and the
timed cost of a step make best (`block_size`, `tree_budget`, `cost_curve`), this machine's floor
(`roofline`) and the speedup a measured tau implies on a chip (`projection`)."""
