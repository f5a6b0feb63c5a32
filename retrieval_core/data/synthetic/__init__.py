"""The synthetic benchmark: scenes, their captions in four languages."""
