"""``python -m pipelines.rerank``."""
from pipelines.rerank.run import main

if __name__ == "__main__":
    main()
