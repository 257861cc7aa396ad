"""``python -m kernels.bench digest``: a fingerprint of every kernel's output, to compare two runs.

Every benchmark case (each public ``kernels`` function, ``kernels.bench.case``) runs once on its
seeded inputs, and the engine decodes on tiny (AR logits, and a DDTree generation's tokens and
trees); each result's bytes are hashed. Two processes that print the same lines computed
bit-identical results: nothing depends on timing, scheduling, or where memory happened to be
allocated. ``.ci/gpu`` runs it twice and compares (``--quick`` shapes unless told otherwise).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import zlib

import numpy as np

from kernels.bench.case import full_sizes, make_cases, quick_sizes


def host_bytes(value) -> bytes:
    """The bytes of a result: device or host arrays, numbers, and tuples or lists of them."""
    if value is None:
        return b""
    if isinstance(value, (tuple, list)):
        return b"".join(host_bytes(item) for item in value)
    if hasattr(value, "copy_to_host"):
        return np.ascontiguousarray(value.copy_to_host()).tobytes()
    if hasattr(value, "_fields"):                      # a named tuple of arrays
        return host_bytes(tuple(value))
    array = np.asarray(value)
    return b"" if array.dtype == object else np.ascontiguousarray(array).tobytes()   # numbers only


def digest(value) -> str:
    return hashlib.sha256(host_bytes(value)).hexdigest()[:16]


def engine_digests(name: str = "tiny") -> dict[str, str]:
    """The engine's AR logits and a DDTree generation (tokens and every round's tree) on ``name``."""
    from ddtree import golden
    from ddtree.config import preset
    from ddtree.drafters import make_drafter
    from ddtree.weights import init_weights
    from kernels import decode as engine_decode
    from kernels.model import Transformer

    config = preset(name)
    model = Transformer(config, init_weights(config, golden.WEIGHT_SEED))
    prompt = golden.default_prompt(name)
    tokens, logits = engine_decode.generate_ar(model, prompt, 24, return_logits=True)
    drafter = make_drafter("noisy", model, prompt, 24, continuation=tokens)
    ddtree_tokens, trace = engine_decode.generate_ddtree(model, prompt, 24, drafter, budget=32)
    rounds = [(r.tokens, r.parents, r.accepted, r.bonus) for r in trace.rounds]
    return {f"engine {name} AR logits": digest(logits),
            f"engine {name} DDTree": digest((ddtree_tokens, rounds))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernels.bench digest",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="Kimi K2.6 shapes instead of the quick ones")
    parser.add_argument("--no-engine", action="store_true", help="the kernels only")
    args = parser.parse_args(argv)
    for case in make_cases(full_sizes() if args.full else quick_sizes()):
        inputs = case.setup(zlib.crc32(case.name.encode()))
        result = case.call(inputs)                     # the inputs too: some kernels work in place
        print(f"{case.name:28s} {digest((result, inputs))}", flush=True)
    if not args.no_engine:
        for name, value in engine_digests().items():
            print(f"{name:28s} {value}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
