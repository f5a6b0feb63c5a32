"""The model: the single-stream transformer, its collation, backbones, checkpoints and baselines."""
