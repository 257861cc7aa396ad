"""Kernel versions the engine does not run, kept for what they teach (see ``lab/harness.py``)."""
