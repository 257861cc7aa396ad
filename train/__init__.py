"""Training the tiny-code target and its block drafter with PyTorch (the ``train`` extra), on the
Python standard library's own source. The numpy reference and the engine never import this."""
