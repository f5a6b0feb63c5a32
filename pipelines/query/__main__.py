"""``python -m pipelines.query``."""
from pipelines.query.run import main

if __name__ == "__main__":
    main()
