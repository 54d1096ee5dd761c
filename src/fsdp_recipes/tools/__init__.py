"""Layer 7: offline commands (`fsdp-recipes ...`): memory estimator, Accelerate-config linter, topology generator, recipe catalog, DeepSpeed converter."""
