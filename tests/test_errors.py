"""The catalogue of refused inputs: every bad input is refused by name, before anything changes.

Each row of ``CASES`` is one rejected call: the area, the name its message must contain (the
parameter, flag, tensor or file), the bad value as a reader would write it, the call (made against
a fresh ``World``) and the error type. ``test_case_is_refused_by_name`` runs each row and checks
the error type, that the message names the parameter, and that the world (cache contents and
length, every weight, ``forward_count``) is as it was. ``walkthrough/90_errors.py`` runs the same
rows and writes the table with the messages for docs/errors.md, so the page cannot drift from
what the code raises.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import pathlib
from collections.abc import Callable

import numpy as np
import pytest

from ddtree import cli, golden
from ddtree.accept import accept
from ddtree.budget import CostTable
from ddtree.config import ModelConfig, preset
from ddtree.decode import MAX_BUDGET, ddtree_round, generate_ar, generate_ddtree
from ddtree.drafters import NGramDrafter, NoisyOracleDrafter, OracleDrafter, make_drafter
from ddtree.kv_cache import CacheOverflowError, LatentKVCache, compact
from ddtree.model import Transformer
from ddtree.rope import apply_rope
from ddtree.tree import DraftTree, build_tree, top_candidates, visibility
from ddtree.weights import init_weights, load_pretrained, save_pretrained

PRESET = "micro"


@dataclasses.dataclass
class World:
    """What a rejected call could damage: a micro model, its weights and a prefilled cache."""
    directory: pathlib.Path
    config: ModelConfig
    weights: dict
    model: Transformer
    cache: LatentKVCache
    prompt: np.ndarray

    def values(self, **change) -> dict:
        """The config as a dict (a ``config.json``), with ``change`` applied."""
        return self.config.to_dict() | change

    def yarn(self, **change) -> dict:
        """The config's fields with a YaRN rope_scaling that is valid except for ``change``."""
        scaling = dict(type="yarn", factor=4.0, original_max_position_embeddings=128, beta_fast=32.0,
                       beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0) | change
        return self.values(rope_scaling=scaling)

    def with_weight(self, name: str, make) -> dict:
        """A copy of the weights with tensor ``name`` replaced by ``make(its current value)``."""
        return self.weights | {name: make(self.weights[name].copy())}

    def checkpoint(self, damage: Callable[[pathlib.Path], None] | None = None) -> pathlib.Path:
        """The world's checkpoint directory (written once), then ``damage(directory)``."""
        path = self.directory / "checkpoint"
        save_pretrained(path, self.config, self.weights)
        if damage is not None:
            damage(path)
        return path


def make_world(directory) -> World:
    """A fresh world whose files go under ``directory`` (created)."""
    pathlib.Path(directory).mkdir(parents=True, exist_ok=True)
    config = preset(PRESET)
    weights = init_weights(config, golden.WEIGHT_SEED)
    model = Transformer(config, weights)
    prompt = golden.default_prompt(PRESET)
    cache = model.new_cache(16)
    model.forward(cache, prompt[:-1])
    model.forward_count = 0
    return World(pathlib.Path(directory), config, weights, model, cache, prompt)


def state(world: World) -> dict:
    return dict(length=world.cache.length, latent=world.cache.latent.copy(), rope=world.cache.rope.copy(),
                forward_count=world.model.forward_count,
                weights={name: value.copy() for name, value in world.weights.items()})


def assert_unchanged(before: dict, after: dict) -> None:
    assert after["length"] == before["length"], "cache length changed"
    assert after["forward_count"] == before["forward_count"], "forward_count changed"
    assert np.array_equal(after["latent"], before["latent"], equal_nan=True), "cache latents changed"
    assert np.array_equal(after["rope"], before["rope"], equal_nan=True), "cache rope keys changed"
    assert after["weights"].keys() == before["weights"].keys(), "weights dict changed"
    for name, value in before["weights"].items():
        assert np.array_equal(after["weights"][name], value), f"weight {name} changed"


# --------------------------------------------------------------------------------------------
# command lines: what they print to stderr when they exit with status 2

class CommandLineError(Exception):
    """A command line refused: exit status 2, this message on stderr, nothing on stdout."""


def command(main, argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as exit_:                   # argparse refuses with SystemExit(2)
            status = exit_.code
    if status == 2:
        if out.getvalue():
            raise AssertionError(f"printed before refusing: {out.getvalue()[:200]!r}")
        raise CommandLineError(err.getvalue().strip().splitlines()[-1])
    return status


# --------------------------------------------------------------------------------------------
# damaged files

def write(name: str, data: bytes):
    def damage(directory: pathlib.Path) -> None:
        (directory / name).write_bytes(data)
    return damage


def truncate_tensors(directory: pathlib.Path) -> None:
    path = directory / "model.safetensors"
    path.write_bytes(path.read_bytes()[:1000])


def edit_config(**change):
    def damage(directory: pathlib.Path) -> None:
        path = directory / "config.json"
        path.write_text(json.dumps(json.loads(path.read_text()) | change))
    return damage


def remove(name: str):
    def damage(directory: pathlib.Path) -> None:
        (directory / name).unlink()
    return damage


# --------------------------------------------------------------------------------------------
# drafters that misbehave

class ShapedDrafter:
    """Proposes ``make(block_size)``, whatever the context."""

    def __init__(self, make, vocab_size=96):
        self.make, self.vocab_size = make, vocab_size

    def propose(self, context_tokens, block_size):
        return self.make(block_size)


def nan(value: np.ndarray) -> np.ndarray:
    value.flat[7] = np.nan
    return value


def inf(value: np.ndarray) -> np.ndarray:
    value.flat[3] = np.inf
    return value


# --------------------------------------------------------------------------------------------
# the catalogue

@dataclasses.dataclass(frozen=True)
class Case:
    area: str
    names: str                         # what the message must contain
    bad: str                           # the bad input, as a reader would write it
    call: Callable[[World], object]
    error: type[Exception] = ValueError


def ddtree(world: World, drafter=None, **options):
    options = dict(block_size=4, budget=8) | options
    return generate_ddtree(world.model, world.prompt, 4, drafter or NGramDrafter(96), **options)


def ar(world: World, prompt=None, max_new_tokens=4):
    return generate_ar(world.model, world.prompt if prompt is None else prompt, max_new_tokens)


def forward(world: World, tokens=(1, 2), **options):
    return world.model.forward(world.cache, np.array(tokens), **options)


def config_with(**change):
    return lambda world: ModelConfig.from_dict(world.values(**change))


def yarn_with(**change):
    return lambda world: ModelConfig.from_dict(world.yarn(**change))


def model_with(name: str, make):
    return lambda world: Transformer(world.config, world.with_weight(name, make))


def load_damaged(damage):
    return lambda world: load_pretrained(world.checkpoint(damage))


def transposed(value: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(value.T)


def demo(*flags):
    return lambda world: command(cli.main, ["demo", "--tokens", "2", *flags])


def golden_check(directory=None):
    return lambda world: command(golden.main, ["--check", "--dir", str(directory or world.directory)])


NAN_DRAFT = ShapedDrafter(lambda block: np.full((block - 1, 96), np.nan, np.float32))
FLAT_DRAFT = ShapedDrafter(lambda block: np.zeros((block - 1, 96), np.float32))
ONE_ROW_TOO_MANY = ShapedDrafter(lambda block: np.zeros((block, 96), np.float32))
STRING_DRAFT = ShapedDrafter(lambda block: np.full((block - 1, 96), "x"))
LAYER = "model.layers.1."

CASES = [
    # configuration: ModelConfig(...) and ModelConfig.from_dict(config.json values)
    Case("config", "hidden_size", "hidden_size=0", config_with(hidden_size=0)),
    Case("config", "hidden_size", "hidden_size=True (a bool)", config_with(hidden_size=True)),
    Case("config", "hidden_size", "hidden_size=32.0 (a float)", config_with(hidden_size=np.float64(32))),
    Case("config", "num_hidden_layers", "num_hidden_layers=-1", config_with(num_hidden_layers=-1)),
    Case("config", "q_lora_rank", "q_lora_rank=True", config_with(q_lora_rank=True)),
    Case("config", "q_lora_rank", "q_lora_rank=0", config_with(q_lora_rank=0)),
    Case("config", "rms_norm_eps", "rms_norm_eps=True", config_with(rms_norm_eps=True)),
    Case("config", "rms_norm_eps", "rms_norm_eps=0.0", config_with(rms_norm_eps=0.0)),
    Case("config", "routed_scaling_factor", "routed_scaling_factor=nan",
         config_with(routed_scaling_factor=float("nan"))),
    Case("config", "norm_topk_prob", 'norm_topk_prob="false" (a string)',
         config_with(norm_topk_prob="false")),
    Case("config", "rope_theta", "rope_theta=1.0", config_with(rope_theta=1.0)),
    Case("config", "qk_rope_head_dim", "qk_rope_head_dim=7 (odd)", config_with(qk_rope_head_dim=7)),
    Case("config", "n_group", "n_routed_experts=4, n_group=3", config_with(n_group=3)),
    Case("config", "topk_group", "topk_group=3 > n_group=2", config_with(topk_group=3)),
    Case("config", "num_experts_per_tok", "num_experts_per_tok=3 > the 2 experts of the kept group",
         config_with(num_experts_per_tok=3)),
    Case("config", "n_group", "n_group=4 (one expert per group)", config_with(n_group=4, topk_group=2)),
    Case("config", "hidden_size", "config.json without hidden_size",
         lambda w: ModelConfig.from_dict({k: v for k, v in w.values().items() if k != "hidden_size"})),
    Case("config", "config", "a list instead of a dict", lambda w: ModelConfig.from_dict([1, 2])),
    Case("config", "rope_scaling", 'rope_scaling="yarn" (a string)', config_with(rope_scaling="yarn")),
    Case("config", "rope_scaling type", 'rope_scaling type "linear"',
         config_with(rope_scaling={"type": "linear", "factor": 2.0})),
    Case("config", "original_max_position_embeddings", "yarn without original_max_position_embeddings",
         config_with(rope_scaling={"type": "yarn", "factor": 4.0})),
    Case("config", "rope_scaling keys", "yarn with a key 'bogus'", yarn_with(bogus=1)),
    Case("config", "rope_scaling.factor", 'factor="4" (a string)', yarn_with(factor="4")),
    Case("config", "rope_scaling.factor", "factor=2.0 != 512 / 128", yarn_with(factor=2.0)),
    Case("config", "rope_scaling.beta_fast", "beta_fast=null", yarn_with(beta_fast=None)),
    Case("config", "rope_scaling.beta_fast", "beta_fast=NaN", yarn_with(beta_fast=float("nan"))),
    Case("config", "rope_scaling.beta_fast", "beta_fast=inf", yarn_with(beta_fast=float("inf"))),
    Case("config", "rope_scaling.beta_slow", "beta_slow=-1", yarn_with(beta_slow=-1.0)),
    Case("config", "beta_fast", "beta_fast=1 <= beta_slow=2", yarn_with(beta_fast=1.0, beta_slow=2.0)),
    Case("config", "rope_scaling.mscale", "mscale=-1", yarn_with(mscale=-1.0)),
    Case("config", "preset", 'preset("huge")', lambda w: preset("huge")),

    # weights: Transformer(config, weights), init_weights
    Case("weights", "self_attn.kv_b_proj.weight", "kv_b_proj transposed (same element count)",
         model_with(LAYER + "self_attn.kv_b_proj.weight", transposed)),
    Case("weights", "self_attn.q_a_proj.weight", "q_a_proj transposed (same element count)",
         model_with(LAYER + "self_attn.q_a_proj.weight", transposed)),
    Case("weights", "lm_head.weight", "lm_head with fewer rows than the vocabulary",
         model_with("lm_head.weight", lambda x: x[:-1])),
    Case("weights", "lm_head.weight", "a NaN in lm_head", model_with("lm_head.weight", nan)),
    Case("weights", "mlp.experts.2.up_proj.weight", "an inf in an expert",
         model_with(LAYER + "mlp.experts.2.up_proj.weight", inf)),
    Case("weights", "model.embed_tokens.weight", "float64 embeddings",
         model_with("model.embed_tokens.weight", lambda x: x.astype(np.float64))),
    Case("weights", "model.norm.weight", "a tensor missing",
         lambda w: Transformer(w.config, {k: v for k, v in w.weights.items() if k != "model.norm.weight"})),
    Case("weights", "model.layers.1", "weights of 2 layers, config of 1",
         lambda w: Transformer(ModelConfig.from_dict(w.values(num_hidden_layers=1)), w.weights)),
    Case("weights", "weights", "a list instead of a dict",
         lambda w: Transformer(w.config, list(w.weights.values()))),
    Case("weights", "attention", 'attention="flash"',
         lambda w: Transformer(w.config, w.weights, attention="flash")),
    Case("weights", "config", "init_weights for kimi-k2.6 (terabytes)",
         lambda w: init_weights(preset("kimi-k2.6"))),
    Case("weights", "seed", "init_weights seed=-1", lambda w: init_weights(w.config, seed=-1)),

    # checkpoints: load_pretrained(directory), save_pretrained
    Case("checkpoint", "model.safetensors", "model.safetensors truncated", load_damaged(truncate_tensors)),
    Case("checkpoint", "model.safetensors", "model.safetensors empty",
         load_damaged(write("model.safetensors", b""))),
    Case("checkpoint", "model.safetensors", "model.safetensors garbage",
         load_damaged(write("model.safetensors", b"\x07" * 64))),
    Case("checkpoint", "model.safetensors", "model.safetensors missing",
         load_damaged(remove("model.safetensors")),
         FileNotFoundError),
    Case("checkpoint", "config.json", "config.json missing",
         load_damaged(remove("config.json")), FileNotFoundError),
    Case("checkpoint", "config.json", "config.json not JSON",
         load_damaged(write("config.json", b"{hidden_size: 32"))),
    Case("checkpoint", "config.json", "config.json a JSON list",
         load_damaged(write("config.json", b"[1, 2]"))),
    Case("checkpoint", "rope_scaling", 'config.json with rope_scaling "yarn"',
         load_damaged(edit_config(rope_scaling="yarn"))),
    Case("checkpoint", "norm_topk_prob", 'config.json with norm_topk_prob "false"',
         load_damaged(edit_config(norm_topk_prob="false"))),
    Case("checkpoint", "model.layers.1", "config.json edited from 2 layers to 1",
         load_damaged(edit_config(num_hidden_layers=1))),
    Case("checkpoint", "model_type", 'config.json with model_type "llama"',
         load_damaged(edit_config(model_type="llama"))),
    Case("checkpoint", "lm_head.weight", "save_pretrained with a wrong lm_head",
         lambda w: save_pretrained(w.directory / "out", w.config,
                                   w.with_weight("lm_head.weight", lambda x: x[:, :3]))),

    # the model's forward and its cache
    Case("model", "tokens", "a token = vocab_size", lambda w: forward(w, tokens=(1, 96))),
    Case("model", "tokens", "float tokens", lambda w: forward(w, tokens=(1.0, 2.0))),
    Case("model", "tokens", "no tokens", lambda w: forward(w, tokens=())),
    Case("model", "positions", "position 512 = max_position_embeddings",
         lambda w: forward(w, positions=np.array([5, 512]))),
    Case("model", "visible", "a (3, 3) mask for 2 rows", lambda w: forward(w, visible=np.ones((3, 3), bool))),
    Case("model", "capacity", "12 new rows into 11 free slots", lambda w: forward(w, tokens=range(12)),
         CacheOverflowError),
    Case("model", "capacity", "new_cache(0)", lambda w: w.model.new_cache(0)),
    Case("model", "capacity", "new_cache(True)", lambda w: w.model.new_cache(True)),
    Case("model", "capacity", "LatentKVCache(capacity=-3)", lambda w: LatentKVCache(2, -3, 16, 4)),
    Case("model", "accepted", "compact with accepted=[0, 0]",
         lambda w: compact(w.cache, 1, np.array([0, 0]))),
    Case("model", "accepted", "compact past the cache's end",
         lambda w: compact(w.cache, 3, np.array([0, 4]))),
    Case("model", "start", "compact with start=1.0 (a float)",
         lambda w: compact(w.cache, 1.0, np.array([0, 1]))),
    Case("model", "positions", "apply_rope at fractional positions",
         lambda w: apply_rope(np.ones((2, 4), np.float32), np.array([0.5, 1.0]),
                              np.ones(2, np.float32))),
    Case("model", "truncate length", "truncate(99)", lambda w: w.cache.truncate(99)),

    # decoding: generate_ar, generate_ddtree, ddtree_round
    Case("decode", "prompt", "a prompt token = vocab_size", lambda w: ar(w, prompt=np.array([1, 96]))),
    Case("decode", "prompt", "a negative prompt token", lambda w: ar(w, prompt=np.array([-1, 5]))),
    Case("decode", "prompt", "an empty prompt", lambda w: ar(w, prompt=np.array([], np.int64))),
    Case("decode", "prompt", "a 2-D prompt", lambda w: ar(w, prompt=np.ones((2, 2), np.int64))),
    Case("decode", "max_new_tokens", "max_new_tokens=-1", lambda w: ar(w, max_new_tokens=-1)),
    Case("decode", "max_new_tokens", "max_new_tokens=2.0", lambda w: ar(w, max_new_tokens=2.0)),
    Case("decode", "max_position_embeddings", "prompt + max_new_tokens > 512",
         lambda w: ar(w, max_new_tokens=510)),
    Case("decode", "block_size", "block_size=0", lambda w: ddtree(w, block_size=0)),
    Case("decode", "block_size", "block_size=True", lambda w: ddtree(w, block_size=True)),
    Case("decode", "block_size", "block_size=5000 > max_position_embeddings",
         lambda w: ddtree(w, block_size=5000)),
    Case("decode", "budget", "budget=2.5", lambda w: ddtree(w, budget=2.5)),
    Case("decode", "budget", "budget=-1", lambda w: ddtree(w, budget=-1)),
    Case("decode", "budget", f"budget={MAX_BUDGET + 1} > MAX_BUDGET",
         lambda w: ddtree(w, budget=MAX_BUDGET + 1)),
    Case("decode", "cost_table", "budget='auto' without cost_table", lambda w: ddtree(w, budget="auto")),
    Case("decode", "CostTable.verify", "cost_table=CostTable(1.0, (1.0, 0.0))",
         lambda w: ddtree(w, budget="auto", cost_table=CostTable(1.0, (1.0, 0.0)))),
    Case("decode", "cost_table", "cost_table= with budget=8",
         lambda w: ddtree(w, cost_table=CostTable(1.0, (1.0,)))),
    Case("decode", "topk", "topk=0", lambda w: ddtree(w, topk=0)),
    Case("decode", "vocab_size", "a drafter for 100 tokens, a model of 96",
         lambda w: ddtree(w, NGramDrafter(100))),
    Case("decode", "drafter", "a drafter without propose", lambda w: ddtree(w, object())),
    Case("decode", "drafter logits", "a drafter proposing L + 1 rows", lambda w: ddtree(w, ONE_ROW_TOO_MANY)),
    Case("decode", "drafter logits", "a drafter proposing NaN", lambda w: ddtree(w, NAN_DRAFT)),
    Case("decode", "ShapedDrafter.propose", "a drafter proposing strings", lambda w: ddtree(w, STRING_DRAFT)),
    Case("decode", "drafter logits", "ddtree_round with a drafter proposing NaN",
         lambda w: ddtree_round(w.model, w.cache, w.prompt, NAN_DRAFT, 4, 8, None)),
    Case("decode", "capacity", "ddtree_round with a tree larger than the free slots",
         lambda w: ddtree_round(w.model, w.cache, w.prompt, FLAT_DRAFT, 8, 40, None), CacheOverflowError),

    # drafters
    Case("drafters", "sequence", "OracleDrafter with a token = vocab_size",
         lambda w: OracleDrafter([1, 2, 96], 96)),
    Case("drafters", "seed", "OracleDrafter seed=-1", lambda w: OracleDrafter([1, 2], 96, seed=-1)),
    Case("drafters", "vocab_size", "NGramDrafter(vocab_size=0)", lambda w: NGramDrafter(0)),
    Case("drafters", "max_ngram", "NGramDrafter(max_ngram=0)", lambda w: NGramDrafter(96, max_ngram=0)),
    Case("drafters", "context_tokens", "a context token >= the drafter's vocab_size",
         lambda w: NGramDrafter(50).propose(w.prompt, 4)),
    Case("drafters", "block_size", "propose(..., block_size=0)",
         lambda w: NGramDrafter(96).propose(w.prompt, 0)),
    Case("drafters", "top1_rate", "NoisyOracleDrafter(top1_rate=1.5)",
         lambda w: NoisyOracleDrafter([1, 2], 96, top1_rate=1.5)),
    Case("drafters", "drafter", 'make_drafter("magic")',
         lambda w: make_drafter("magic", w.model, w.prompt, 4)),

    # the tree and acceptance (the discrete steps)
    Case("tree", "k must be", "top_candidates(k=0)",
         lambda w: top_candidates(np.zeros((3, 96), np.float32), 0)),
    Case("tree", "top_logprobs", "unsorted top_logprobs",
         lambda w: build_tree(1, np.array([[-2.0, -1.0]]), np.array([[3, 4]]), 4)),
    Case("tree", "top_ids", "repeated top_ids in a row",
         lambda w: build_tree(1, np.array([[-1.0, -2.0]]), np.array([[3, 3]]), 4)),
    Case("tree", "parents", "parents=[0, 0]", lambda w: visibility(np.array([0, 0]))),
    Case("tree", "posterior_tokens", "a posterior shorter than the tree",
         lambda w: accept(build_tree(1, np.array([[-1.0]]), np.array([[3]]), 1), np.array([3]))),
    Case("tree", "siblings", "a tree whose siblings carry the same token",
         lambda w: accept(DraftTree(tokens=[1, 3, 3], parents=[-1, 0, 0], depths=[0, 1, 1],
                                    ranks=[-1, 0, 1], logprobs=[0.0, -1.0, -2.0]), np.array([3, 1, 2]))),

    # command lines: python -m ddtree demo, python -m ddtree.golden
    Case("cli", "--block-size", "demo --block-size 0", demo("--block-size", "0"), CommandLineError),
    Case("cli", "--topk", "demo --topk 0", demo("--topk", "0"), CommandLineError),
    Case("cli", "--seed", "demo --seed -1", demo("--seed", "-1"), CommandLineError),
    Case("cli", "--budget", "demo --budget 10000000", demo("--budget", "10000000"), CommandLineError),
    Case("cli", "--budget", "demo --budget 1e11", demo("--budget", "1e11"), CommandLineError),
    Case("cli", "--tokens", "demo --tokens -1", demo("--tokens", "-1"), CommandLineError),
    Case("cli", "--tokens", "demo --tokens 5000", demo("--tokens", "5000"), CommandLineError),
    Case("cli", "--preset", "demo --preset kimi-k2.6", demo("--preset", "kimi-k2.6"), CommandLineError),
    Case("cli", "--budget", "demo --budget -3", demo("--budget", "-3"), CommandLineError),
    Case("cli", "--cost-table", "demo --budget auto without --cost-table", demo("--budget", "auto"),
         CommandLineError),
    Case("cli", "--prompt", "demo --preset micro --prompt 5,96",
         demo("--preset", "micro", "--prompt", "5,96"), CommandLineError),
    Case("cli", "--checkpoint", "demo --checkpoint /missing --prompt 5",
         demo("--checkpoint", "/missing", "--prompt", "5"), CommandLineError),
    Case("cli", "--checkpoint", "demo --checkpoint <a directory without config.json>",
         lambda w: command(cli.main, ["demo", "--checkpoint", str(w.checkpoint(remove("config.json"))),
                                      "--prompt", "5"]), CommandLineError),
    Case("cli", "--prompt", "demo --checkpoint <dir> without --prompt",
         lambda w: command(cli.main, ["demo", "--checkpoint", str(w.checkpoint())]), CommandLineError),
    Case("cli", "--dir", "golden --check --dir /missing", golden_check("/missing"), CommandLineError),
    Case("cli", "tiny.npz", "golden --check --dir <an empty directory>", golden_check(), CommandLineError),
]


def case_id(case: Case) -> str:
    return f"{case.area}: {case.bad}"


def refusal(case: Case, world: World) -> Exception:
    """Run ``case`` against ``world``; returns the error it raised (fails if it raised none)."""
    try:
        case.call(world)
    except Exception as error:                      # the test checks its type
        return error
    raise AssertionError(f"{case_id(case)}: accepted, expected {case.error.__name__}")


@pytest.fixture
def world(tmp_path):
    return make_world(tmp_path)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_case_is_refused_by_name(case, world):
    before = state(world)
    error = refusal(case, world)
    assert type(error) is case.error, f"{type(error).__name__}: {error}"
    assert case.names in str(error), f"the message does not name {case.names!r}: {error}"
    assert_unchanged(before, state(world))


def test_every_area_has_cases_and_ids_are_unique():
    assert len({case_id(case) for case in CASES}) == len(CASES)
    areas = {"config", "weights", "checkpoint", "model", "decode", "drafters", "tree", "cli"}
    assert {case.area for case in CASES} == areas


def test_a_preset_whose_weights_fit_still_builds(monkeypatch):
    """The memory check refuses by size, not by name: the same config builds when memory allows."""
    from ddtree import weights as module

    config = preset("micro")
    largest = max(int(np.prod(shape)) for shape in module.weight_shapes(config).values())
    needed = module.weights_nbytes(config) + 8 * largest
    monkeypatch.setattr(module, "available_memory", lambda: needed)
    assert set(init_weights(config)) == set(module.weight_shapes(config))
    monkeypatch.setattr(module, "available_memory", lambda: needed - 1)
    with pytest.raises(ValueError, match=r"init_weights needs 0\.00 GiB"):
        init_weights(config)


def test_checkpoint_errors_name_the_file(world):
    directory = world.checkpoint(truncate_tensors)
    with pytest.raises(ValueError) as error:
        load_pretrained(directory)
    assert str(directory / "model.safetensors") in str(error.value)


def test_cli_checks_flags_before_decoding(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("decoded before checking the flags")

    monkeypatch.setattr("ddtree.decode.generate_ar", refuse)
    with pytest.raises(CommandLineError, match="--seed"):
        command(cli.main, ["demo", "--seed", "-1"])


def clean(message: str, world: World) -> str:
    """The message as the docs show it: machine-specific paths and sizes replaced by placeholders."""
    message = message.replace(str(world.directory), "<dir>")
    if "of memory is available" in message:
        message = message.split(", but only")[0] + ", but only <available> GiB of memory is available"
    return message


def catalogue(directory) -> list[tuple[Case, Exception, str]]:
    """Every case run against a fresh world: (case, its error, its message cleaned for the docs)."""
    rows = []
    for number, case in enumerate(CASES):
        world = make_world(pathlib.Path(directory) / f"case{number}")
        error = refusal(case, world)
        rows.append((case, error, clean(str(error), world)))
    return rows
