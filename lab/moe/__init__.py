"""MoE kernel versions the engine does not run (``lab/harness.py``)."""
