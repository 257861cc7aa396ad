"""Versions of kernels.mla.attention_paths that the engine does not run."""
