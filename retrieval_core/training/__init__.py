"""Training: objectives, losses, negatives, initialisation and the dev evaluation."""
