"""``python -m pipelines.build_index``."""
from pipelines.build_index.run import main

if __name__ == "__main__":
    main()
