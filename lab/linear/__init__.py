"""Versions of kernels.linear.linear that the engine does not run (``lab/harness.py``)."""
