"""Tree builder and top-K versions the engine does not run."""
