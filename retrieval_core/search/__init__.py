"""Search and rerank: embeddings on disk, exact and FAISS top-k, index choice, score fusion."""
