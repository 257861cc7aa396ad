"""Cross-check against Hugging Face transformers' ``DeepseekV3ForCausalLM``.

A checkpoint written by ``ddtree.weights.save_pretrained`` must load in transformers with every
parameter accounted for, and give the same logits, the same expert routing and the same greedy
continuation as ``ddtree.model.Transformer`` (numpy backend). This is the independent check that
our MLA, NeoX rope + YaRN, MoE routing and config.json agree with the reference implementation.

Needs torch and transformers; skipped where either is missing (CI has neither). Run with
``python -m pytest -q -s tests/test_transformers_crosscheck.py``: ``-s`` shows the max abs logit
difference per preset. Everything is fp32 (TF32 off), on CUDA when present, else CPU. transformers
runs its plain PyTorch code paths (eager attention, eager experts), so no fused-kernel choice of
the machine changes what is compared.
"""

import dataclasses
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from packaging.version import Version  # noqa: E402  (a transformers dependency)

from ddtree.config import preset  # noqa: E402
from ddtree.decode import generate_ar  # noqa: E402
from ddtree.model import Transformer  # noqa: E402
from ddtree.moe import route  # noqa: E402
from ddtree.weights import init_weights, load_pretrained, save_pretrained  # noqa: E402
from tests.helpers import assert_close, assert_exact  # noqa: E402

PRESETS = ["tiny", "tiny-b", "micro"]
PROMPT_LENGTH = 12
NEW_TOKENS = 8
# Whole-model fp32 logits through several layers and two independent implementations (numpy vs
# torch, different summation orders): measured ~1e-6 of max|logit| on CPU; 1e-4 leaves headroom
# for GPU GEMMs, and a wrong rope, scale or routing gives far more. A wrong norm eps does not (the
# latent-norm eps slip moved tiny-b by only 8e-6): test_latent_norm_eps_matches_transformers
# magnifies that one with small latents.
LOGIT_TOLERANCE = 1e-4
# routing compares discrete choices: they are meaningful only if no runner-up is this close
ROUTING_MARGIN = 1e-4

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True, scope="module")
def fp32_torch():
    """fp32 everywhere: default dtype, no TF32 matmuls; restored afterwards."""
    saved = (torch.get_default_dtype(), torch.backends.cuda.matmul.allow_tf32,
             torch.backends.cudnn.allow_tf32)
    torch.set_default_dtype(torch.float32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.set_default_dtype(saved[0])
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[1:]


def load_hf(directory):
    """``DeepseekV3ForCausalLM.from_pretrained`` in fp32, eval mode; asserts a complete load."""
    kwargs = dict(attn_implementation="eager", output_loading_info=True)
    if Version(transformers.__version__) >= Version("4.56"):
        kwargs["dtype"] = torch.float32          # `torch_dtype` was renamed `dtype`
    else:
        kwargs["torch_dtype"] = torch.float32
    if hasattr(transformers.PreTrainedModel, "set_experts_implementation"):
        kwargs["experts_implementation"] = "eager"   # transformers 5: else grouped_mm where it can
    model, info = transformers.DeepseekV3ForCausalLM.from_pretrained(str(directory), **kwargs)
    # a missing key would be silently random-initialised by transformers
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info[kind], f"transformers reports {kind}: {sorted(info[kind])[:5]}"
    assert model.dtype == torch.float32
    return model.to(DEVICE).eval()


def checkpoint(tmp_path, config, weights):
    """Save with ddtree, load with transformers; returns (ddtree Transformer, HF model)."""
    save_pretrained(tmp_path, config, weights)
    return Transformer(config, weights), load_hf(tmp_path)


def fixed_prompt(config) -> np.ndarray:
    return np.random.default_rng(1234).integers(0, config.vocab_size, PROMPT_LENGTH)


def hf_logits(model, prompt) -> np.ndarray:
    with torch.no_grad():
        ids = torch.as_tensor(prompt, dtype=torch.long, device=DEVICE)[None]
        return model(ids).logits[0].float().cpu().numpy()


def compare_logits(actual, expected, label):
    """|HF - ddtree| <= LOGIT_TOLERANCE * max|ddtree logit| everywhere; prints the max difference."""
    scale = float(np.abs(expected).max())
    diff = float(np.abs(actual.astype(np.float64) - expected).max())
    print(f"\n{label}: max |logit| {scale:.4g}, max abs diff {diff:.3g} ({diff / scale:.2g} relative)")
    assert_close(actual, expected, rtol=0.0, atol=LOGIT_TOLERANCE * scale, name=label)


def top2_gap(logits) -> np.ndarray:
    """Per row: best minus second-best logit (how safe a greedy argmax is)."""
    top = np.sort(logits, axis=-1)[..., -2:]
    return top[..., 1] - top[..., 0]


@pytest.mark.parametrize("name", PRESETS)
def test_config_json_is_read_as_written(tmp_path, name):
    """transformers sees our config.json fields (rope, eps, MoE) with the values we wrote."""
    config = preset(name)
    save_pretrained(tmp_path, config, init_weights(config, seed=0))
    hf = transformers.AutoConfig.from_pretrained(str(tmp_path))
    assert hf.model_type == "deepseek_v3" and hf.rope_interleave is False
    assert hf.tie_word_embeddings is False
    for field in ["hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
                  "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
                  "num_experts_per_tok", "n_shared_experts", "first_k_dense_replace", "n_group",
                  "topk_group", "routed_scaling_factor", "norm_topk_prob", "rms_norm_eps",
                  "moe_intermediate_size", "intermediate_size", "max_position_embeddings"]:
        assert getattr(hf, field) == getattr(config, field), field
    # transformers 5 moves rope_theta and rope_scaling into rope_parameters; 4.x keeps them apart
    rope = getattr(hf, "rope_parameters", None) or dict(getattr(hf, "rope_scaling", None) or {})
    theta = rope.get("rope_theta", getattr(hf, "rope_theta", None))
    assert theta == config.rope_theta
    if config.rope_scaling is None:
        assert rope.get("rope_type", "default") == "default"
    else:
        assert rope["rope_type"] == "yarn"
        for key, value in config.rope_scaling.items():
            assert rope[key] == value, key


@pytest.mark.parametrize("name", PRESETS)
def test_prefill_logits_match(tmp_path, name):
    config = preset(name)
    ours, hf = checkpoint(tmp_path, config, init_weights(config, seed=0))
    prompt = fixed_prompt(config)
    expected = ours.logits(prompt)                                # [T, V]
    actual = hf_logits(hf, prompt)                                # [T, V]
    compare_logits(actual, expected, f"{name} prefill logits")
    # greedy choices too, where no near-tie makes them ambiguous
    safe = top2_gap(expected) > 2 * LOGIT_TOLERANCE * np.abs(expected).max()
    assert safe.sum() >= PROMPT_LENGTH - 1, "fixed prompt has near-tied argmaxes; pick another seed"
    assert_exact(actual.argmax(-1)[safe], expected.argmax(-1)[safe], name=f"{name} argmax")


@pytest.mark.parametrize("name", PRESETS)
def test_routing_matches(tmp_path, name):
    """Every MoE layer picks the same experts with the same weights (routing flips reported apart
    from arithmetic): ddtree.moe.route runs on the exact router input transformers saw."""
    config = preset(name)
    weights = init_weights(config, seed=0)
    _, hf = checkpoint(tmp_path, config, weights)
    seen = {}

    def recorder(layer):
        def hook(module, args, output):
            _, topk_weights, topk_indices = output
            seen[layer] = (args[0].reshape(-1, config.hidden_size).float().cpu().numpy(),
                           topk_indices.cpu().numpy(), topk_weights.float().cpu().numpy())
        return hook

    moe_layers = [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]
    handles = [hf.model.layers[i].mlp.gate.register_forward_hook(recorder(i)) for i in moe_layers]
    try:
        hf_logits(hf, fixed_prompt(config))
    finally:
        for handle in handles:
            handle.remove()
    assert sorted(seen) == moe_layers
    for layer in moe_layers:
        x, hf_ids, hf_weights = seen[layer]                           # [T, D], [T, k], [T, k]
        p = f"model.layers.{layer}.mlp.gate."
        gate, bias = weights[p + "weight"], weights[p + "e_score_correction_bias"]
        assert route_margin(x, gate, bias, config) > ROUTING_MARGIN, \
            f"layer {layer}: a near-tie in routing makes the comparison ambiguous; pick another seed"
        ids, ws = route(x, gate, bias, config)                        # [T, k] descending
        # transformers' topk(sorted=False) order is unspecified: compare sorted by expert id
        order, hf_order = np.argsort(ids, axis=-1), np.argsort(hf_ids, axis=-1)
        assert_exact(np.take_along_axis(hf_ids, hf_order, -1), np.take_along_axis(ids, order, -1),
                     name=f"{name} layer {layer} expert ids")
        assert_close(np.take_along_axis(hf_weights, hf_order, -1), np.take_along_axis(ws, order, -1),
                     rtol=1e-5, atol=1e-6, name=f"{name} layer {layer} expert weights")


def route_margin(x, gate, bias, config) -> float:
    """Smallest gap between the last kept and the first dropped candidate: groups, then experts."""
    choice = 1.0 / (1.0 + np.exp(-(x.astype(np.float64) @ gate.T))) + bias   # [T, E]
    tokens, experts = choice.shape
    k, kept_groups = config.num_experts_per_tok, config.topk_group
    margins = []
    if config.n_group > 1:
        group_score = np.sort(choice.reshape(tokens, config.n_group, -1), -1)[..., -2:].sum(-1)  # [T, G]
        ranked_groups = np.sort(group_score, -1)[:, ::-1]
        margins.append(ranked_groups[:, kept_groups - 1] - ranked_groups[:, kept_groups])
        keep = group_score >= ranked_groups[:, kept_groups - 1:kept_groups]                   # [T, G]
        choice = np.where(np.repeat(keep, experts // config.n_group, -1), choice, -np.inf)
    ranked = np.sort(choice, -1)[:, ::-1]                                                     # [T, E]
    if k < experts:
        margins.append(ranked[:, k - 1] - ranked[:, k])
    return float(min(m.min() for m in margins)) if margins else np.inf


@pytest.mark.parametrize("name", PRESETS)
def test_greedy_continuation_matches(tmp_path, name):
    """transformers' generate (greedy, its own KV cache) emits generate_ar's tokens and logits."""
    config = preset(name)
    ours, hf = checkpoint(tmp_path, config, init_weights(config, seed=0))
    prompt = fixed_prompt(config)
    tokens, step_logits = generate_ar(ours, prompt, NEW_TOKENS, return_logits=True)   # [N], [N, V]
    scale = np.abs(step_logits).max()
    assert (top2_gap(step_logits) > 2 * LOGIT_TOLERANCE * scale).all(), \
        "a greedy step is near-tied, so token equality would be ambiguous; pick another seed"
    # no end-of-sequence stop: a random model may emit any id (DeepseekV3Config defaults eos to 1)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = hf.generate(torch.as_tensor(prompt, dtype=torch.long, device=DEVICE)[None],
                          do_sample=False, max_new_tokens=NEW_TOKENS,
                          output_logits=True, return_dict_in_generate=True)
    hf_tokens = out.sequences[0, PROMPT_LENGTH:].cpu().numpy()
    hf_step_logits = torch.stack(out.logits)[:, 0].float().cpu().numpy()   # [N, V]
    assert_exact(hf_tokens, tokens, name=f"{name} greedy tokens")
    compare_logits(hf_step_logits, step_logits, f"{name} greedy step logits")


def test_latent_norm_eps_matches_transformers(tmp_path):
    """q_a_layernorm and kv_a_layernorm use eps 1e-6 whatever rms_norm_eps says.

    transformers (like DeepSeek's and Kimi's own code) builds them as ``RMSNorm(rank)`` with the
    default eps 1e-6; only the hidden-size norms take ``rms_norm_eps`` (Kimi K2.6: 1e-5). With
    latents of mean square ~1e-6 the two epsilons give O(1) different logits, so this fails
    loudly if the model uses rms_norm_eps there.
    """
    config = dataclasses.replace(preset("tiny"), rms_norm_eps=1e-5)
    weights = init_weights(config, seed=0)
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}.self_attn."
        weights[p + "q_a_proj.weight"] *= np.float32(1e-3)
        weights[p + "kv_a_proj_with_mqa.weight"][:config.kv_lora_rank] *= np.float32(1e-3)
    ours, hf = checkpoint(tmp_path, config, weights)
    prompt = fixed_prompt(config)
    compare_logits(hf_logits(hf, prompt), ours.logits(prompt), "tiny (eps 1e-5, small latents) logits")


@pytest.mark.parametrize("name", PRESETS)
def test_transformers_checkpoint_loads_back(tmp_path, name):
    """A checkpoint re-saved by transformers (rope in ``rope_parameters`` under transformers 5)
    loads with ddtree.weights.load_pretrained into the same config and weights."""
    config = preset(name)
    weights = init_weights(config, seed=0)
    save_pretrained(tmp_path / "ours", config, weights)
    load_hf(tmp_path / "ours").save_pretrained(str(tmp_path / "hf"))
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    loaded_config, loaded = load_pretrained(tmp_path / "hf")
    rope_fields = {key: value for key, value in written.items() if "rope" in key}
    assert loaded_config == config, f"rope fields as transformers wrote them: {rope_fields}"
    # transformers 5 may write the experts fused; load_pretrained must hand back our layout
    assert sorted(loaded) == sorted(weights)
    for key, value in weights.items():
        assert_exact(loaded[key], value, name=key)
