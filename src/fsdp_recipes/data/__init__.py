"""Data: `files` loads (Hub or local) and splits, one module per format turns examples into tokens and loss masks
(`chat` for SFT; `text` for pretraining, with its per-rank document streams and their packing), and `rows` packs,
batches and collates for every token-level recipe."""
