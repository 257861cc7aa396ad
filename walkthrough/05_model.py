"""Chapter 5: the model, its latent KV cache, AR greedy decoding, golden bundles, checkpoints.

The layers of chapters 0-4 assemble into a DeepSeek-V3 / Kimi-K2 style decoder. This chapter

* shows the latent cache's reserve / write / commit protocol: a forward that does not fit raises
  before anything changes;
* prefills a prompt and decodes token by token (greedy AR), counting target forwards, and checks
  the cached decode against one causal pass over the whole sequence;
* reproduces the committed golden bundle and plots each step's top-1 minus top-2 logit gap
  (the figure): the margin that makes "same tokens" a fair test for other implementations;
* saves and reloads a Hugging Face format checkpoint;
* runs the whole model through the numba.cuda kernels (``backend="numba"``) on preset "micro"
  and prints the largest logit difference from numpy.

    python walkthrough/05_model.py

Writes docs/assets/figures/05_model_golden_gaps.png and 05_model_report.txt (what it prints).
"""

import collections
import json
import tempfile

import chapter  # walkthrough/chapter.py: figures, the report file, the Agg backend
import matplotlib.pyplot as plt
import numpy as np

import kernels  # noqa: F401  (decides GPU or CUDA simulator before numba loads)
from ddtree import golden
from ddtree.config import preset
from ddtree.decode import generate_ar
from ddtree.kv_cache import CacheOverflowError
from ddtree.model import Transformer
from ddtree.weights import init_weights, load_pretrained, save_pretrained
from kernels import device

STEM = "05_model"
LAUNCH_SECONDS = 22e-6     # a numba kernel launch from Python, measured on the project's H200


# --8<-- [start:cache_demo]
def cache_demo(model: Transformer) -> None:
    c = model.config
    cache = model.new_cache(10)
    print(f"cache for {c.num_hidden_layers} layers x 10 slots x ({c.kv_lora_rank} latent + "
          f"{c.qk_rope_head_dim} rope) floats: latent {cache.latent.shape}, rope {cache.rope.shape}")
    model.forward(cache, golden.default_prompt("tiny-b"))
    before = cache.latent.copy()
    try:
        model.forward(cache, np.array([1, 2, 3]))
    except CacheOverflowError as error:
        unchanged = cache.length == 8 and np.array_equal(cache.latent, before, equal_nan=True)
        print(f"  after an 8-token prefill, a 3-token forward raises: {error}")
        print(f"  cache length still {cache.length}, every slot unchanged: {unchanged}")
# --8<-- [end:cache_demo]


def ar_demo(model: Transformer) -> dict:
    bundle = golden.load_bundle("tiny-b")
    prompt, new = bundle["prompt"], bundle["tokens"].size
    model.forward_count = 0
    tokens, step_logits = generate_ar(model, prompt, new, return_logits=True)
    print(f"AR greedy, tiny-b, prompt {prompt.tolist()}: {new} new tokens in {model.forward_count} "
          f"target forwards (1 prefill + {model.forward_count - 1} decodes)")
    print(f"  tokens equal the golden bundle: {np.array_equal(tokens, bundle['tokens'])}; "
          f"max |logit - golden| = {np.abs(step_logits - bundle['logits']).max():.1e}")
    assert np.array_equal(tokens, bundle["tokens"]), "AR must reproduce the golden bundle"
    full = model.logits(np.concatenate([prompt, tokens]))                     # one causal pass
    recomputed = full[prompt.size - 1:-1]                                     # the rows that chose each token
    print(f"  cached decode vs one causal pass over all {prompt.size + new} tokens: "
          f"max |diff| = {np.abs(step_logits - recomputed).max():.1e}")
    return bundle


# --8<-- [start:checkpoint_demo]
def checkpoint_demo(config, weights, model: Transformer) -> None:
    with tempfile.TemporaryDirectory() as directory:
        path = save_pretrained(directory, config, weights)
        files = {p.name: p.stat().st_size for p in sorted(path.iterdir())}
        hf = json.loads((path / "config.json").read_text())
        loaded_config, loaded = load_pretrained(directory)
    same = loaded_config == config and all(np.array_equal(loaded[k], weights[k]) for k in weights)
    prompt = golden.default_prompt("tiny-b")
    logits_equal = np.array_equal(Transformer(loaded_config, loaded).logits(prompt), model.logits(prompt))
    print(f"checkpoint: {files}; model_type {hf['model_type']}, rope_interleave {hf['rope_interleave']}, "
          f"{len(weights)} tensors")
    print(f"  load_pretrained gives the same config and tensors: {same}; same logits: {logits_equal}")
# --8<-- [end:checkpoint_demo]


def numba_backend_demo() -> float:
    config = preset("micro")
    weights = init_weights(config, golden.WEIGHT_SEED)
    prompt = golden.default_prompt("micro")
    reference = Transformer(config, weights).logits(prompt)                   # [T, V]
    model = Transformer(config, weights, backend="numba")
    calls = count_operation_calls(model)
    with chapter.timed("numba backend forward"):
        logits = model.logits(prompt)
    diff = float(np.abs(logits - reference).max())
    print(f"backend='numba' on micro ({config.describe()}), prompt of {prompt.size} tokens, "
          f"on the {device.where()}")
    print(f"  max |logit numpy - numba| = {diff:.1e} (max |logit| {np.abs(reference).max():.1f}); "
          f"same greedy tokens: {np.array_equal(logits.argmax(-1), reference.argmax(-1))}")
    assert np.array_equal(logits.argmax(-1), reference.argmax(-1)), "numba and numpy greedy tokens differ"
    total = sum(calls.values())
    per_layer = (total - 3) / config.num_hidden_layers          # embed, final norm, lm_head once
    kimi_layers = preset("kimi-k2.6").num_hidden_layers
    print(f"  {total} operation calls per forward ({dict(calls)}): {per_layer:g} per layer + 3; "
          f"Kimi K2.6's {kimi_layers} layers: {per_layer * kimi_layers + 3:g} calls, "
          f">= {(per_layer * kimi_layers + 3) * LAUNCH_SECONDS * 1e3:.0f} ms of launches at 22 us each")
    return diff


def count_operation_calls(model: Transformer) -> collections.Counter:
    """Wrap every operation in ``model.ops`` with a call counter; returns the live Counter."""
    calls = collections.Counter()
    for name, operation in vars(model.ops).items():
        if callable(operation):
            def counted(*args, _operation=operation, _name=name, **kwargs):
                calls[_name] += 1
                return _operation(*args, **kwargs)
            setattr(model.ops, name, counted)
    return calls


def plot_gaps(measured_diff: float) -> None:
    fig, ax = plt.subplots(figsize=(8, 4.6))
    width = 0.4
    for i, name in enumerate(golden.GOLDEN_PRESETS):
        bundle = golden.load_bundle(name)
        gaps = golden.top2_gap(bundle["logits"])                              # [steps]
        steps = np.arange(gaps.size)
        ax.bar(steps + (i - 0.5) * width, gaps, width, label=f"{name} (min {float(bundle['min_gap']):.3f})")
        print(f"golden {name}: {gaps.size} steps, min top-1/top-2 gap {float(bundle['min_gap']):.4f} "
              f"at step {int(gaps.argmin())}")
    ax.axhline(golden.MIN_GAP_FLOOR, color="tab:red", ls="--", lw=1,
               label=f"refusal floor {golden.MIN_GAP_FLOOR:g}")
    ax.axhline(measured_diff, color="black", ls=":", lw=1,
               label=f"numba vs numpy logit difference (micro): {measured_diff:.0e}")
    ax.set_yscale("log")
    ax.set_xlabel("generated step")
    ax.set_ylabel("top-1 minus top-2 logit")
    ax.set_title("Golden bundles: how far each greedy choice is from a tie")
    ax.set_ylim(1e-6, 30)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    chapter.save_figure(fig, STEM, "golden_gaps")


if __name__ == "__main__":
    with chapter.report(STEM):
        config = preset("tiny-b")
        weights = init_weights(config, golden.WEIGHT_SEED)
        model = Transformer(config, weights)
        print(f"tiny-b: {config.describe()}, layer 0 dense, layers 1+ MoE")
        cache_demo(model)
        ar_demo(model)
        checkpoint_demo(config, weights, model)
        diff = numba_backend_demo()
        plot_gaps(diff)
