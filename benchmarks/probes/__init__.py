"""The probes: what a model has learnt and where it errs (family_probe, binding_probe, rerank_errors,
learning_curves), and the statistics behind the reported choices (bootstrap_coverage, fusion_rule)."""
