"""Pixels in: decoding image files (every file converted or rejected with its reason), a pretrained ImageNet
backbone (EfficientNet-Lite0) and the grid "regions" it gives each image, the staged schema's stand-in for
detector region features."""
