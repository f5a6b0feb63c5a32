"""The distributed retrieve-and-rerank job: plan (options, input checks), graph (what workers run), run
(waves, resume, manifest, CLI)."""
