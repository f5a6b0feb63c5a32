"""Your own queries against a built index as a batch job: plan (options, input checks), graph (what workers run:
``retrieval_core.search.query`` per batch), run (resume, outputs, CLI)."""
