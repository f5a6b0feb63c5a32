"""Data: the staged schema, file access, readers of the source formats, staging, manifests and the synthetic
benchmark."""
