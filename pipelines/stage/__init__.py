"""Staging a data manifest into checksummed shards: plan (options, read tasks), graph (what workers run), run
(summary, resume, CLI)."""
