"""specgen: speculative decoding for autoregressive image generators."""
__version__ = "0.1.0"
