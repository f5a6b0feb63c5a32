"""Bulk encoding with the bi-encoder: plan (options, output shards, resume), graph (what workers run), run
(launcher, manifest, CLI)."""
