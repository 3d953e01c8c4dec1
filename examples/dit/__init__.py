"""Pixel-space DiT trained with flow matching and flexsparse attention (``python -m examples.dit.train``)."""
