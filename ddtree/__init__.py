"""ddtree: speculative decoding with draft trees, the readable numpy reference."""

__version__ = "0.1.0"
