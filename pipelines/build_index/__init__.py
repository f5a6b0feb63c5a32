"""Sharded FAISS indexes: plan (options), graph (one index shard per embedding shard), run (training,
resume, manifest, CLI)."""
