"""Chapter 5: the model, its latent KV cache, AR greedy decoding, golden bundles, checkpoints.

The layers of chapters 0-4 assemble into a DeepSeek-V3 / Kimi-K2 style decoder. This chapter

* shows the latent cache's reserve / write / commit protocol: a forward that does not fit raises
  before anything changes;
* prefills a prompt and decodes token by token (greedy AR), counting target forwards, and checks
  the cached decode against one causal pass over the whole sequence;
* reproduces the committed golden bundle and plots each step's top-1 minus top-2 logit gap
  (the figure): the margin that makes "same tokens" a fair test for other implementations;
* saves and reloads a Hugging Face format checkpoint;
* records every operation call of one forward on preset "micro" and replays each call through
  its numba.cuda twin (the kernel function of the same name), printing the largest difference.

    .venv/bin/python walkthrough/05_model.py

Writes docs/assets/figures/05_model_golden_gaps.png and 05_model_report.txt (what it prints).
"""

import collections
import importlib
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
from ddtree.model import OPERATIONS, Transformer
from ddtree.weights import load_pretrained, save_pretrained
from kernels import device

STEM = "05_model"


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
        print(f"  after an 8-token prefill, a 3-token forward raises CacheOverflowError:\n    {error}")
        print(f"  cache length still {cache.length}, every slot unchanged: {unchanged}")
# --8<-- [end:cache_demo]


def ar_demo(setup) -> float:
    """Greedy AR from tiny-b's golden prompt, checked against the bundle and a causal pass.

    Returns the largest logit difference between absorbed and naive attention over the same
    tokens: how far two correct float32 implementations of this model drift apart.
    """
    model, prompt, golden_tokens = setup.model, setup.prompt, setup.ar_tokens
    model.forward_count = 0
    tokens, step_logits = generate_ar(model, prompt, golden_tokens.size, return_logits=True)
    print(f"AR greedy, tiny-b, prompt {prompt.tolist()}:")
    print(f"  {tokens.size} new tokens in {model.forward_count} target forwards "
          f"(1 prefill + {model.forward_count - 1} decodes)")
    bundle_logits = golden.load_bundle("tiny-b")["logits"]
    print(f"  tokens equal the golden bundle: {np.array_equal(tokens, golden_tokens)}; "
          f"max |logit - golden| = {np.abs(step_logits - bundle_logits).max():.1e}")
    assert np.array_equal(tokens, golden_tokens), "AR must reproduce the golden bundle"
    sequence = np.concatenate([prompt, tokens])
    full = model.logits(sequence)                                             # one causal pass
    recomputed = full[prompt.size - 1:-1]                                     # the rows that chose each token
    print(f"  cached decode vs one causal pass over all {sequence.size} tokens: "
          f"max |diff| = {np.abs(step_logits - recomputed).max():.1e}")
    naive = Transformer(setup.config, setup.weights, attention="naive").logits(sequence)
    reassociation = float(np.abs(naive - full).max())
    print(f"  absorbed vs naive attention (chapter 3), same tokens: max |diff| = {reassociation:.1e}")
    return reassociation


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
    print(f"checkpoint: {files}")
    print(f"  model_type {hf['model_type']}, rope_interleave {hf['rope_interleave']}, {len(weights)} tensors")
    print(f"  load_pretrained gives the same config and tensors: {same}; same logits: {logits_equal}")
# --8<-- [end:checkpoint_demo]


def twin(name: str):
    """The numba.cuda function with the same name as numpy operation ``name`` (same module stem)."""
    stem = next(stem for stem, names in OPERATIONS.items() if name in names)
    return getattr(importlib.import_module(f"kernels.{stem}"), name)


# --8<-- [start:replay_on_kernels]
def replay_on_kernels(calls) -> dict[str, float]:
    """Run every recorded numpy call again through its numba twin, on the same arguments.

    Returns, per operation, the largest |numpy - numba| relative to the largest |numpy output|.
    """
    worst = collections.defaultdict(float)
    for call in calls:
        got = np.asarray(twin(call.name)(*call.args, **call.kwargs))
        want = np.asarray(call.result)
        worst[call.name] = max(worst[call.name], float(np.abs(got - want).max() / np.abs(want).max()))
    return dict(worst)
# --8<-- [end:replay_on_kernels]


def kernels_demo() -> None:
    """Record one forward of micro, replay each operation call on its numba twin, count the calls."""
    setup = chapter.golden_model("micro")
    config = setup.config
    with chapter.record_ops(setup.model, *vars(setup.model.ops)) as calls:
        setup.model.logits(setup.prompt)
    with chapter.timed("numba replay of one forward"):
        worst = replay_on_kernels(calls)
    counts = collections.Counter(call.name for call in calls)
    print(f"micro ({config.describe()}):")
    print(f"  one forward over {setup.prompt.size} tokens, each call replayed on its numba twin "
          f"({device.where()})")
    print(f"  {'operation':<17} {'calls':>5}  max |numpy - numba| / max |numpy|")
    for name, diff in worst.items():
        print(f"  {name:<17} {counts[name]:>5}  {diff:.1e}")
    per_layer = (len(calls) - 3) / config.num_hidden_layers          # embed, final norm, lm_head once
    kimi_layers = preset("kimi-k2.6").num_hidden_layers
    kimi_calls = per_layer * kimi_layers + 3
    with chapter.section("calls"):
        chapter.print_gpu()
        print(f"{len(calls)} operation calls per forward: {per_layer:g} per layer + 3 "
              f"(embed, final norm, lm_head)")
        print(f"Kimi K2.6, {kimi_layers} layers: {kimi_calls:g} calls per forward, at least one launch each:")
        print(f"  >= {kimi_calls * chapter.gpu().launch * 1e3:.1f} ms of host time per forward in launches")
    assert max(worst.values()) < 1e-4, "a numba twin disagrees with numpy"


def plot_gaps(reassociation: float) -> None:
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
    ax.axhline(reassociation, color="black", ls=":", lw=1,
               label=f"absorbed vs naive attention, largest logit difference: {reassociation:.0e}")
    ax.set_yscale("log")
    ax.set_xlabel("generated step")
    ax.set_ylabel("top-1 minus top-2 logit")
    ax.set_title("Golden bundles: how far each greedy choice is from a tie")
    ax.set_ylim(1e-6, 30)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    chapter.save_figure(fig, STEM, "golden_gaps")


def main() -> None:
    """The cache protocol, AR against the golden bundle, a checkpoint round trip, the kernels."""
    setup = chapter.golden_model("tiny-b")
    print(f"tiny-b: {setup.config.describe()}\n  layer 0 dense, layers 1+ MoE")
    cache_demo(setup.model)
    reassociation = ar_demo(setup)
    checkpoint_demo(setup.config, setup.weights, setup.model)
    kernels_demo()
    plot_gaps(reassociation)


if __name__ == "__main__":
    with chapter.report(STEM):
        main()
