"""``python -m pipelines.stage``."""
from pipelines.stage.run import main

if __name__ == "__main__":
    main()
