"""specscope: fast, lossless and explainable speculative decoding."""

__version__ = "0.1.0"
