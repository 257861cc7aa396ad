"""The PyTorch training twin (train/): same logits and routing as the numpy reference, exact weight
round trips, V3's router-bias rule, the drafter's batched block rows, and CPU smoke runs of both
training scripts on a synthetic corpus. Skipped without torch (CI has none)."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ddtree.config import preset  # noqa: E402
from ddtree.drafters import MASK, PAD, block_rows  # noqa: E402
from ddtree.model import Transformer  # noqa: E402
from ddtree.moe import route  # noqa: E402
from ddtree.weights import init_weights, load_pretrained  # noqa: E402
from tests.helpers import assert_close, assert_exact  # noqa: E402
from train.drafter import DrafterOptions, block_rows_batch, train_drafter  # noqa: E402
from train.model import MoE, from_ddtree, to_ddtree, update_router_bias  # noqa: E402
from train.target import TargetOptions, train_target  # noqa: E402

PRESETS = ["micro", "tiny", "tiny-b"]
# fp32 through several layers in two implementations (different summation orders)
LOGIT_TOLERANCE = 1e-4


def torch_logits(model, prompt):
    with torch.no_grad():
        logits, counts = model.eval()(torch.as_tensor(prompt, dtype=torch.long)[None])
    return logits[0].numpy(), [c.numpy() for c in counts]


@pytest.mark.parametrize("name", PRESETS)
def test_logits_match_the_numpy_reference(name):
    config = preset(name)
    weights = init_weights(config, seed=2)
    prompt = np.random.default_rng(7).integers(0, config.vocab_size, 23)
    expected = Transformer(config, weights).logits(prompt)                         # [T, V]
    actual, _ = torch_logits(from_ddtree(config, weights), prompt)
    assert_close(actual, expected, rtol=0.0, atol=LOGIT_TOLERANCE * np.abs(expected).max(), name=name)


@pytest.mark.parametrize("name", PRESETS)
def test_routing_matches_the_numpy_reference(name):
    """Each MoE layer picks ddtree.moe.route's experts with its weights, on the same router input,
    and the counts the forward returns are those choices'."""
    config = preset(name)
    weights = init_weights(config, seed=2)
    model = from_ddtree(config, weights)
    seen = []
    hooks = [m.register_forward_hook(lambda mod, args, out: seen.append((mod, args[0])))
             for m in model.modules() if isinstance(m, MoE)]
    _, counts = torch_logits(model, np.random.default_rng(8).integers(0, config.vocab_size, 31))
    for hook in hooks:
        hook.remove()
    layers = [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]
    assert len(seen) == len(layers) == len(counts)
    for layer, (module, x), layer_counts in zip(layers, seen, counts, strict=True):
        x = x.reshape(-1, config.hidden_size)
        with torch.no_grad():
            ids, ws = module.route(x)
        p = f"model.layers.{layer}.mlp.gate."
        gate, bias = weights[p + "weight"], weights[p + "e_score_correction_bias"]
        expected_ids, expected_ws = route(x.numpy(), gate, bias, config)
        order, expected_order = ids.argsort(-1).numpy(), np.argsort(expected_ids, -1)
        assert_exact(np.take_along_axis(ids.numpy(), order, -1),
                     np.take_along_axis(expected_ids, expected_order, -1), name=f"{name} layer {layer} ids")
        assert_close(np.take_along_axis(ws.numpy(), order, -1),
                     np.take_along_axis(expected_ws, expected_order, -1), rtol=1e-5, atol=1e-6)
        assert_exact(layer_counts, np.bincount(expected_ids.ravel(), minlength=config.n_routed_experts))


@pytest.mark.parametrize("name", PRESETS)
def test_weights_round_trip_exactly(name):
    config = preset(name)
    weights = init_weights(config, seed=5)
    back = to_ddtree(from_ddtree(config, weights))
    assert list(back) == list(weights)
    for key, value in weights.items():
        assert back[key].dtype == np.float32
        assert_exact(back[key], value, name=key)


def test_router_bias_moves_by_the_sign_rule():
    config = preset("tiny-b")                                     # 2 MoE layers of 12 experts
    weights = init_weights(config, seed=1)
    model = from_ddtree(config, weights)
    counts = [torch.tensor([5, 0, 3, 3, 9, 1, 3, 3, 2, 4, 3, 0]), torch.full((12,), 7)]
    update_router_bias(model, counts, rate=0.25)
    after = to_ddtree(model)
    for layer, load in zip((1, 2), counts, strict=True):
        key = f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
        load = load.numpy().astype(np.float64)
        expected = weights[key] + np.float32(0.25) * np.sign(load.mean() - load).astype(np.float32)
        assert_exact(after[key], expected.astype(np.float32), name=key)
    assert after["model.layers.1.mlp.gate.weight"] is not weights["model.layers.1.mlp.gate.weight"]
    assert_exact(after["model.layers.1.mlp.gate.weight"], weights["model.layers.1.mlp.gate.weight"])
    with pytest.raises(ValueError, match="one \\(E,\\) tensor per MoE layer \\(2\\)"):
        update_router_bias(model, counts[:1])
    with pytest.raises(ValueError, match="must be \\(E,\\) = \\(12,\\)"):
        update_router_bias(model, [torch.ones(12), torch.ones(11)])


@pytest.mark.parametrize("window, depths", [(5, 4), (8, 1), (1, 3), (3, 2)])
def test_block_rows_batch_equals_block_rows(window, depths):
    stream = torch.as_tensor(np.random.default_rng(window + depths).integers(3, 90, 40))
    roots = torch.tensor([0, 1, window - 1, window, 17, 39, 39, 20])
    lengths = torch.tensor([1, 2, 1, 3, 40, 1, 4, 21])          # what the context holds, root included
    for cut in (None, lengths):
        rows = block_rows_batch(stream, roots, window, depths, cut).numpy()
        assert rows.shape == (roots.numel(), window + depths - 1)
        for b, root in enumerate(roots.tolist()):
            first = 0 if cut is None else max(0, root - int(cut[b]) + 1)
            expected = block_rows(stream[first:root + 1].numpy(), window, depths)
            assert_exact(rows[b], expected, name=f"root {root}")
    assert (rows[:, window:] == MASK).all()
    assert rows[0, 0] == PAD if window > 1 else True


# ---------------------------------------------------------------------------------------------
# CPU smoke runs on a synthetic corpus

def synthetic_stream(rng, size):
    """Documents (each after one end-of-text token 0) of short repeated patterns over ids 3..40."""
    out = []
    while len(out) < size:
        start, period = rng.integers(3, 30), rng.integers(2, 8)
        out += [0] + [int(start + i % period) for i in range(rng.integers(20, 60))]
    return np.asarray(out[:size], dtype=np.uint16)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    directory = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    meta = {"python": "3.11.7", "tokenizer_sha256": "0" * 64}
    for split, size in (("train", 12000), ("heldout", 1500)):
        tokens = synthetic_stream(rng, size)
        np.save(directory / f"{split}.npy", tokens)
        meta[split] = {"files": 3, "bytes": 3 * size, "tokens": size}
    (directory / "corpus.json").write_text(json.dumps(meta))
    return directory


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("target")
    options = TargetOptions(corpus=str(corpus), out=str(out), minutes=2.0, device="cpu", steps=40,
                            config="micro", seq_len=48, batch=8, lr=1e-2, warmup=5, log_every=5)
    return out, train_target(options)


def test_target_training_lowers_the_loss_and_records_it(trained):
    out, record = trained
    assert record["steps"] == 40
    history = [entry["loss"] for entry in record["history"]]
    assert history[-1] < 0.5 * history[0]
    held = record["heldout"]
    assert held["tokens_predicted"] == 1499
    assert held["loss_nats_per_token"] < held["unigram_nats_per_token"]
    assert held["bits_per_byte"] == pytest.approx(held["loss_nats_per_token"] * 1499 / 4500 / np.log(2))
    assert json.loads((out / "training.json").read_text()) == json.loads(json.dumps(record))
    shares = record["expert_load_share"]["heldout"]
    assert len(shares) == 1 and 0 <= shares[0]["min"] <= 0.25 <= shares[0]["max"] <= 1


def test_target_export_round_trips(trained):
    """The export loads in ddtree and gives the torch model's logits on the same weights."""
    out, _ = trained
    config, weights = load_pretrained(out)
    assert config == preset("micro")
    prompt = np.random.default_rng(3).integers(0, config.vocab_size, 19)
    expected = Transformer(config, weights).logits(prompt)
    actual, _ = torch_logits(from_ddtree(config, weights), prompt)
    assert_close(actual, expected, rtol=0.0, atol=LOGIT_TOLERANCE * np.abs(expected).max())
    biases = [weights[f"model.layers.{i}.mlp.gate.e_score_correction_bias"] for i in (1,)]
    assert np.abs(biases[0]).max() > 0                       # the bias moved during training


@pytest.mark.parametrize("labels", ["target", "data"])
def test_drafter_trains_and_exports_the_contract(trained, corpus, tmp_path, labels):
    target_dir, _ = trained
    out = tmp_path / "drafter"
    options = DrafterOptions(target=str(target_dir), corpus=str(corpus), out=str(out), device="cpu",
                             steps=6, labels=labels, window=16, max_depths=5, teacher_len=64,
                             min_context=24, roots=4, batch=2, eval_roots=64, warmup=2, log_every=2)
    record = train_drafter(options)
    assert json.loads((out / "drafter.json").read_text()) == {
        "kind": "block", "window": 16, "max_depths": 5, "pad_token_id": PAD, "mask_token_id": MASK}
    config, weights = load_pretrained(out)
    micro = preset("micro")
    assert config.num_hidden_layers == 2 and config.first_k_dense_replace == 2
    assert config.hidden_size == micro.hidden_size and config.vocab_size == micro.vocab_size
    assert record["steps"] == 6 and record["heldout"]["roots"] == 64
    for key in ("top1_agreement_with_target", "top1_accuracy_on_data", "loss_nats_on_data"):
        assert len(record["heldout"][key]) == 5
    _, target_weights = load_pretrained(target_dir)
    assert "embed_tokens.weight" in record["initialised_from_target"]
    embed = "model.embed_tokens.weight"
    assert not np.array_equal(weights[embed], target_weights[embed])      # copied, then trained


def test_both_scripts_train_under_bf16_autocast(corpus, tmp_path, monkeypatch):
    """The CUDA path's precision, bf16 autocast over fp32 weights, through the CPU's autocast: a
    few steps of each script give finite losses and exports that load (the GPU runs the rest)."""
    import train.drafter as drafter_module
    import train.target as target_module

    def bf16(device):
        return torch.autocast("cpu", dtype=torch.bfloat16)

    monkeypatch.setattr(target_module, "autocast", bf16)
    monkeypatch.setattr(drafter_module, "autocast", bf16)
    target, drafter = tmp_path / "target", tmp_path / "drafter"
    options = TargetOptions(corpus=str(corpus), out=str(target), minutes=2.0, device="cpu", steps=4,
                            config="micro", seq_len=48, batch=8, lr=1e-2, warmup=2, log_every=2)
    record = train_target(options)
    assert record["steps"] == 4 and all(np.isfinite(entry["loss"]) for entry in record["history"])
    options = DrafterOptions(target=str(target), corpus=str(corpus), out=str(drafter), device="cpu", steps=2,
                             labels="target", window=16, max_depths=5, teacher_len=64, min_context=24,
                             roots=4, batch=2, eval_roots=64, warmup=1, log_every=1)
    assert train_drafter(options)["steps"] == 2
    assert load_pretrained(target)[0] == preset("micro")
    assert load_pretrained(drafter)[0].num_hidden_layers == 2
