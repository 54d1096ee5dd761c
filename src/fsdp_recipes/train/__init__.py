"""Layer 4: the pieces of a training loop: config, losses, optimizer and schedule, metrics, evaluation,
checkpoints, reference models, the classification head."""
