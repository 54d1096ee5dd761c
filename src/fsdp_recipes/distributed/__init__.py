"""Layer 1: the Accelerator for a launch (FSDP2 on GPUs and on CPU), collectives, checks of the Accelerate config a run was launched with."""
