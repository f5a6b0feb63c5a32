"""Evaluation: recall, bootstrap intervals, and the metrics of a ranking run."""
