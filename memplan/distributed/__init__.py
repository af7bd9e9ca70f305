"""Data-parallel training, one rank at a time: torch's own wrappers run on rank 0 of torch's fake
process group, over fake tensors, so what they allocate is traced (`--parallel`, memplan.distributed.ddp)."""
