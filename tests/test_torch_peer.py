"""The PyTorch peer (``kernels.bench.torch_peer``) against the numpy reference.

On the CPU (CI with torch, or any machine): the static-shape step run eagerly (``graphs=False``)
gives ``ddtree.decode.generate_ar``'s greedy tokens exactly and its logits within the whole-model
bound, on micro, tiny and tiny-b. On a GPU (``gpu``): the same through the captured CUDA graph,
from host and from device weights. The peer's tests skip without torch (CI installs none); the
benchmark's import of the peer and its target line are checked everywhere.
"""

import functools
import subprocess
import sys

import numpy as np
import pytest

from ddtree import golden
from ddtree.config import preset
from ddtree.decode import generate_ar
from ddtree.model import Transformer
from ddtree.weights import init_weights
from kernels.bench.engine import targets
from kernels.bench.torch_peer import TorchPeer, generate, peer_rate
from tests.helpers import assert_close, assert_exact


def torch_installed() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


needs_torch = pytest.mark.skipif(not torch_installed(), reason="torch is not installed")

PRESETS = ("micro", "tiny", "tiny-b")
NEW_TOKENS = 13
# fp32 through every layer in two summation orders (numpy's pairwise sums, torch's GEMMs): the
# whole-model bound of tests/test_transformers_crosscheck.py, relative to max |logit|
LOGIT_TOLERANCE = 1e-4


@functools.cache
def weights(name: str) -> dict:
    return init_weights(preset(name), golden.WEIGHT_SEED)


@functools.cache
def reference(name: str, new_tokens: int = NEW_TOKENS):
    model = Transformer(preset(name), weights(name))
    return generate_ar(model, golden.default_prompt(name), new_tokens, return_logits=True)


def assert_logits_close(actual, expected):
    scale = float(np.abs(expected).max())
    assert_close(actual, expected, rtol=LOGIT_TOLERANCE, atol=LOGIT_TOLERANCE * scale, name="logits")


def test_the_benchmark_imports_torch_only_when_a_peer_runs():
    """Importing the engine benchmark and the peer module loads no torch (CI has none)."""
    code = "import sys, kernels.bench.engine, kernels.bench.torch_peer; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_targets_state_the_graph_peer_ratio_and_its_tokens():
    def run(system, rate):
        return {"system": system, "decoder": "AR", "budget": None, "tokens_per_second": rate, "forwards": 9}

    result = {"preset": "tiny", "runs": [run("engine, graphs", 300.0), run("PyTorch, CUDA graph", 400.0),
                       run("transformers eager", 50.0)], "torch_peer_same_tokens": True}
    lines = targets(result)
    assert "engine AR / transformers eager: 6.0x (target >= 5x: met)" in lines
    assert ("engine AR / PyTorch, CUDA graph: 0.75x (target >= 1.0x: missed; the engine's tokens: yes)"
            in lines)
    result["runs"][1]["tokens_per_second"], result["torch_peer_same_tokens"] = 250.0, False
    assert ("engine AR / PyTorch, CUDA graph: 1.20x (target >= 1.0x: met; the engine's tokens: no)"
            in targets(result))


@needs_torch
@pytest.mark.parametrize("name", PRESETS)
def test_eager_step_gives_the_reference_tokens_and_logits(name):
    """graphs=False: the step the graph captures, run eagerly on the CPU; capacity is not a
    multiple of anything (the mask hides the unused slots)."""
    prompt = golden.default_prompt(name)
    peer = TorchPeer(preset(name), weights(name), prompt.size + NEW_TOKENS + 3, "cpu")
    tokens, logits = generate(peer, prompt, NEW_TOKENS, return_logits=True)
    expected_tokens, expected_logits = reference(name)
    assert_exact(tokens, expected_tokens)
    assert logits.shape == expected_logits.shape
    assert_logits_close(logits, expected_logits)


@needs_torch
def test_a_reused_peer_ignores_the_stale_cache():
    """A long generation, then a shorter prompt on the same peer: the slots the first run wrote
    beyond the second's positions stay masked, so the second run equals a fresh reference."""
    name = "tiny-b"
    prompt = golden.default_prompt(name)
    peer = TorchPeer(preset(name), weights(name), prompt.size + NEW_TOKENS, "cpu")
    generate(peer, prompt, NEW_TOKENS)
    short = prompt[:3]
    model = Transformer(preset(name), weights(name))
    expected = generate_ar(model, short, 5)
    assert_exact(generate(peer, short, 5), expected)
    assert_exact(generate(peer, prompt, NEW_TOKENS), reference(name)[0])


@needs_torch
def test_one_new_token_comes_from_the_prompt_alone():
    name = "micro"
    prompt = golden.default_prompt(name)
    peer = TorchPeer(preset(name), weights(name), prompt.size + 1, "cpu")
    assert_exact(generate(peer, prompt, 1), reference(name)[0][:1])


@needs_torch
@pytest.mark.parametrize("kwargs, match", [
    (dict(capacity=1), "capacity must be an integer in"),
    (dict(capacity=10_000), "max_position_embeddings=512"),
    (dict(capacity=True), "capacity must be"),
    (dict(device="tpu"), "device must be one of"),
    (dict(graphs=True), "graphs=True needs device='cuda'"),
])
def test_bad_construction_is_refused(kwargs, match):
    args = dict(config=preset("micro"), weights=weights("micro"), capacity=20, device="cpu") | kwargs
    with pytest.raises(ValueError, match=match):
        TorchPeer(**args)


@needs_torch
def test_bad_generation_is_refused():
    peer = TorchPeer(preset("micro"), weights("micro"), 10, "cpu")
    prompt = golden.default_prompt("micro")                      # 6 tokens
    with pytest.raises(ValueError, match=r"prompt \(6\) \+ new_tokens \(5\) must fit the peer's capacity 10"):
        generate(peer, prompt, 5)
    with pytest.raises(ValueError, match="new_tokens must be a positive integer"):
        generate(peer, prompt, 0)
    with pytest.raises(ValueError, match=r"tokens must lie in \[0, 96\)"):
        generate(peer, [1, 96], 2)


def cuda_or_skip():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ("tiny", "tiny-b"))
def test_graph_gives_the_reference_tokens_and_logits(name):
    """The captured graph replayed per token: the reference's tokens and logits, and the same
    tokens and logits as the eager step on the same GPU; a second generation replays the same graph."""
    cuda_or_skip()
    prompt, new_tokens = golden.default_prompt(name), golden.NEW_TOKENS
    expected_tokens, expected_logits = reference(name, new_tokens)
    graphed = TorchPeer(preset(name), weights(name), prompt.size + new_tokens, "cuda")
    tokens, logits = generate(graphed, prompt, new_tokens, return_logits=True)
    assert graphed.graph is not None
    assert_exact(tokens, expected_tokens)
    assert_logits_close(logits, expected_logits)
    eager = TorchPeer(preset(name), weights(name), prompt.size + new_tokens, "cuda", graphs=False)
    eager_tokens, eager_logits = generate(eager, prompt, new_tokens, return_logits=True)
    assert_exact(eager_tokens, tokens)
    assert_logits_close(eager_logits, logits)
    assert_exact(generate(graphed, prompt, new_tokens), tokens)


@pytest.mark.gpu
def test_device_weights_are_viewed_and_give_the_host_weights_tokens():
    """Weights made on the GPU (``kernels.weights.init_weights``, as the benchmark's ``small``):
    the peer views them in place and decodes as the reference does from their host copy."""
    cuda_or_skip()
    from kernels.weights import init_weights as device_init_weights

    name = "tiny-b"
    config = preset(name)
    device_weights = device_init_weights(config, golden.WEIGHT_SEED)
    host = {key: value.copy_to_host() for key, value in device_weights.items()}
    prompt = golden.default_prompt(name)
    expected = generate_ar(Transformer(config, host), prompt, NEW_TOKENS)
    peer = TorchPeer(config, device_weights, prompt.size + NEW_TOKENS, "cuda")
    embed = device_weights["model.embed_tokens.weight"]
    assert peer.embed.data_ptr() == embed.__cuda_array_interface__["data"][0]
    assert_exact(generate(peer, prompt, NEW_TOKENS), expected)
    rate, same = peer_rate(config, device_weights, prompt, expected, repeats=2)
    assert same and rate > 0
