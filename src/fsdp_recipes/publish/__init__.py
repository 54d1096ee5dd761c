"""Layer 5: what leaves a run: the exported model folder and its card, checkpoint export, the Hub."""
