"""``python -m pipelines.encode``."""
from pipelines.encode.run import main

if __name__ == "__main__":
    main()
