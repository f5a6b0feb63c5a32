"""The suites' machinery behind ``python -m benchmarks.run``: plan the jobs (planner, suites), run and reuse them
(jobs, launch), and turn their outputs into rows (rows, latency, per_query)."""
