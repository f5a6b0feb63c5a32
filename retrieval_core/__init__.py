"""retrieval_core: a plain library (no Beam) for cooperative retrieve-and-rerank image-text retrieval.

Modules: schema (ids, columns, dtypes), manifest (data manifests), synthetic (the generated benchmark),
readers (feature and caption file formats), staging (validation, normalisation, shard writing), store
(reading staged data back), model / collate / checkpoints / losses / train / baseline (the BE/CE/JOIN model
and its training), embeddings, index (sharded FAISS), rerank (score fusion), metrics (recall@K).
"""
