"""Sampling at temperature > 0 (ddtree/sampling.py): the keyed generator and the sampler, DDTree ==
AR token for token at any temperature and seed, and the sampled tree's rejection sampling, exact
in distribution (every outcome enumerated, no statistical test)."""

import functools
import itertools

import numpy as np
import pytest

from ddtree import golden, sampling
from ddtree.accept import accept
from ddtree.cli import main
from ddtree.config import preset
from ddtree.decode import generate_ar, generate_ddtree
from ddtree.drafters import DRAFTERS, make_drafter
from ddtree.model import Transformer
from ddtree.tree import build_tree, top_candidates
from ddtree.weights import init_weights
from tests.helpers import assert_exact

# Random123's tests/kat_vectors, the three "philox4x32 10" lines: counter, key, expected words
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@functools.cache
def tiny():
    config = preset("tiny")
    return Transformer(config, init_weights(config, golden.WEIGHT_SEED)), golden.default_prompt("tiny")


# ------------------------------------------------------------------------------------- generator

@pytest.mark.parametrize("counter, key, expected", PHILOX_KAT)
def test_philox_matches_the_known_answers(counter, key, expected):
    assert tuple(int(word) for word in sampling.philox(counter, key)) == expected


def test_uniforms_are_a_pure_function_of_their_key():
    positions, indices = np.array([0, 7, 2 ** 40 + 3]), np.array([0, 1, 511, 2 ** 32 - 1])
    table = sampling.uniforms(positions, indices, 11, sampling.SAMPLE)               # [3, 4]
    for t, c in itertools.product(range(3), range(4)):                               # alone = in a batch
        alone = sampling.uniforms(positions[t:t + 1], indices[c:c + 1], 11, sampling.SAMPLE)[0, 0]
        assert alone == table[t, c]
    others = [sampling.uniforms(positions, indices, 12, sampling.SAMPLE),             # another seed
              sampling.uniforms(positions, indices, 11, sampling.DRAFT),              # another purpose
              sampling.uniforms(positions + 1, indices, 11, sampling.SAMPLE)]         # another position
    for other in others:
        assert not np.any(other == table)


def test_uniforms_lie_strictly_inside_the_unit_interval():
    u = sampling.uniforms(np.arange(256), np.arange(512), 3, sampling.SAMPLE)       # [256, 512]
    assert u.min() > 0 and u.max() < 1
    assert abs(u.mean() - 0.5) < 5 * np.sqrt(1 / 12 / u.size)                       # 5 sigma, fixed numbers
    extremes = (np.array([0, 2 ** 52 - 1], np.float64) + 0.5) * sampling.UNIT        # the 52-bit ends
    assert extremes[0] > 0 and extremes[1] < 1 and np.isfinite(-np.log(-np.log(extremes))).all()


def test_gumbel_max_draws_from_the_softmax():
    """20000 positions of one row: the frequencies are softmax(logits / T) within 5 sigma. The
    numbers are fixed by (seed, position), so this cannot flake: it fails only if sampling is wrong."""
    logits = np.array([[1.0, 0.0, -1.0, 2.0, 0.5]], np.float32)
    draws = 20000
    for temperature in (0.5, 2.0):
        tokens = sampling.sample(np.repeat(logits, draws, 0), np.arange(draws), temperature, 5)
        expected = sampling.softmax(logits[0].astype(np.float64) / temperature)
        observed = np.bincount(tokens, minlength=5) / draws
        assert np.all(np.abs(observed - expected) < 5 * np.sqrt(expected * (1 - expected) / draws))


def test_temperature_zero_is_argmax():
    logits = np.array([[1, 3, 3, 0], [np.nan, 1, np.nan, 2], [-np.inf] * 4], np.float32)
    assert_exact(sampling.sample(logits, [5, 6, 7], 0.0, 9), np.argmax(logits, axis=-1))


def test_a_draw_depends_only_on_seed_position_and_its_logits():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((9, 50)).astype(np.float32)
    positions = rng.integers(0, 10 ** 6, 9)
    tokens = sampling.sample(logits, positions, 1.0, 4)
    order = rng.permutation(9)
    assert_exact(sampling.sample(logits[order], positions[order], 1.0, 4), tokens[order])
    assert_exact(sampling.sample(logits[2:3], positions[2:3], 1.0, 4), tokens[2:3])
    assert not np.array_equal(sampling.sample(logits, positions, 1.0, 5), tokens)    # another seed


@pytest.mark.parametrize("call, name", [
    (lambda: sampling.sample(np.zeros((1, 4)), [0], -0.5, 0), "temperature"),
    (lambda: sampling.sample(np.zeros((1, 4)), [0], float("nan"), 0), "temperature"),
    (lambda: sampling.sample(np.zeros((1, 4)), [0], float("inf"), 0), "temperature"),
    (lambda: sampling.sample(np.zeros((1, 4)), [0], True, 0), "temperature"),
    (lambda: sampling.sample(np.zeros((1, 4)), [0], "1", 0), "temperature"),
    (lambda: sampling.sample(np.zeros((1, 4)), [0], 1.0, -1), "seed"),
    (lambda: sampling.sample(np.zeros((1, 4)), [0], 1.0, 2 ** 63), "seed"),
    (lambda: sampling.sample(np.zeros((1, 4)), [0], 1.0, 1.5), "seed"),
    (lambda: sampling.sample(np.zeros((1, 4)), [0], 1.0, True), "seed"),
    (lambda: sampling.sample(np.zeros((1, 4)), [-1], 1.0, 0), "positions"),
    (lambda: sampling.sample(np.zeros((1, 4)), [0, 1], 1.0, 0), "positions"),
    (lambda: sampling.sample(np.zeros(4), [0], 1.0, 0), "logits"),
    (lambda: sampling.check_verifier("greedy"), "verifier"),
])
def test_bad_sampling_arguments_are_refused_by_name(call, name):
    with pytest.raises(ValueError, match=name):
        call()


@pytest.mark.parametrize("options, name", [({"temperature": -1.0}, "temperature"), ({"seed": -2}, "seed"),
                                           ({"verifier": "best"}, "verifier")])
def test_decoders_refuse_bad_sampling_options_before_any_forward(options, name):
    model, prompt = tiny()
    model.forward_count = 0
    drafter = make_drafter("ngram", model, prompt, 4)
    with pytest.raises(ValueError, match=name):
        generate_ddtree(model, prompt, 4, drafter, **options)
    if "verifier" not in options:
        with pytest.raises(ValueError, match=name):
            generate_ar(model, prompt, 4, **options)
    assert model.forward_count == 0


# ----------------------------------------------------------------------------------- AR and DDTree

def test_temperature_zero_is_todays_greedy_decoding():
    model, prompt = tiny()
    expected = golden.load_bundle("tiny")["tokens"]
    assert_exact(generate_ar(model, prompt, expected.size, temperature=0.0, seed=123), expected)
    for verifier in sampling.VERIFIERS:
        drafter = make_drafter("noisy", model, prompt, expected.size)
        tokens, _ = generate_ddtree(model, prompt, expected.size, drafter, temperature=0, seed=5,
                                    verifier=verifier)
        assert_exact(tokens, expected)


def test_ar_samples_each_token_from_its_own_logits_and_position():
    model, prompt = tiny()
    tokens, logits = generate_ar(model, prompt, 10, return_logits=True, temperature=0.7, seed=3)
    positions = prompt.size + np.arange(10)
    assert_exact(tokens, sampling.sample(logits, positions, 0.7, 3))
    assert not np.array_equal(tokens, np.argmax(logits, axis=-1))                    # it does sample
    assert_exact(generate_ar(model, prompt, 10, temperature=0.7, seed=3), tokens)      # reproducible
    assert not np.array_equal(generate_ar(model, prompt, 10, temperature=0.7, seed=4), tokens)


SEEDS = (0, 1, 2 ** 40 + 7, 99)
NEW_TOKENS = 12


@functools.cache
def sampled_ar(temperature, seed):
    model, prompt = tiny()
    return generate_ar(model, prompt, NEW_TOKENS, temperature=temperature, seed=seed)


# every drafter, block and budget of the DDTree-core grid at three temperatures; the seed cycles
# through SEEDS with the combination, so each seed meets every other axis somewhere
GRID = [(drafter, block, budget, temperature, SEEDS[i % len(SEEDS)])
        for i, (drafter, block, budget, temperature)
        in enumerate(itertools.product(DRAFTERS, (2, 4, 8, 16), (0, 1, 5, 64), (0.3, 1.0, 2.0)))]


@pytest.mark.parametrize("drafter_name, block_size, budget, temperature, seed", GRID)
def test_ddtree_equals_ar_token_for_token_when_sampling(drafter_name, block_size, budget, temperature, seed):
    model, prompt = tiny()
    expected = sampled_ar(temperature, seed)
    drafter = make_drafter(drafter_name, model, prompt, NEW_TOKENS, continuation=expected)
    tokens, trace = generate_ddtree(model, prompt, NEW_TOKENS, drafter, block_size=block_size, budget=budget,
                                    temperature=temperature, seed=seed)
    assert_exact(tokens, expected, name="DDTree tokens")
    assert trace.committed_tokens == NEW_TOKENS


def test_the_oracle_knows_the_sampled_tokens():
    """Built from the sampled AR continuation, the oracle's chains are all accepted."""
    model, prompt = tiny()
    expected = sampled_ar(1.0, 0)
    drafter = make_drafter("oracle", model, prompt, NEW_TOKENS, continuation=expected)
    tokens, trace = generate_ddtree(model, prompt, NEW_TOKENS, drafter, block_size=4, budget=8,
                                    temperature=1.0, seed=0)
    assert_exact(tokens, expected)
    assert trace.tokens_per_forward == 4.0


# ------------------------------------------------------------------- the sampled tree: rejection

class TableDrafter:
    """A hand-made drafter: per-depth logits conditioned on the context's last token."""

    def __init__(self, table):
        self.table = np.asarray(table, np.float32)                                   # [V, L, V]
        self.vocab_size = self.table.shape[0]

    def propose(self, context, block_size):
        return self.table[int(context[-1]), :block_size - 1]                         # [L, V]


def bigram_world(vocab: int, depths: int, seed: int, holes: bool):
    """A target whose logits depend on the last token only (V, V), and a drafter (V, L, V) that
    disagrees with it; ``holes``: some tokens impossible for the target, others for the drafter."""
    rng = np.random.default_rng(seed)
    target = rng.standard_normal((vocab, vocab)) * 1.5                               # [V, V]
    drafter = target[:, None, :] + rng.standard_normal((vocab, depths, vocab)) * 1.5  # [V, L, V]
    if holes:
        target[:, vocab - 1] = -np.inf                                               # never the last token
        drafter[:, :, 0] = -np.inf                                                   # never proposes 0
    return target.astype(np.float32), TableDrafter(drafter)


def sampled_round(random, target, drafter, last, block_size, budget, topk, temperature):
    """One round of the sampled tree (``generate_ddtree(verifier="rejection")``'s steps) on the table
    target, with ``random`` as the random source; returns the committed tokens."""
    start = 10                                                   # any: an enumeration ignores positions
    draft = drafter.propose(np.array([last]), block_size)        # [L, V]
    shape = build_tree(last, *top_candidates(draft, topk), budget)
    tree = sampling.draw_children(shape, draft, start, temperature, random)
    logits = target[tree.tokens]                                 # [N, V] the target's forward
    accepted, bonus = sampling.rejection_walk(tree, logits, draft, start, temperature, random)
    return tuple(int(t) for t in tree.tokens[accepted[1:]]) + (bonus,)


@pytest.mark.parametrize("block_size, budget, topk", [(3, 3, 2), (2, 3, 3), (4, 3, 1), (3, 5, 3), (2, 4, 4)])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("holes", [False, True])
def test_rejection_sampling_commits_the_targets_distribution_exactly(block_size, budget, topk, temperature,
                                                                    holes):
    vocab, horizon = 4, 3
    target, drafter = bigram_world(vocab, block_size - 1, seed=block_size * 10 + budget, holes=holes)

    @functools.cache
    def round_outcomes(last):
        run = functools.partial(sampled_round, target=target, drafter=drafter, last=last,
                                block_size=block_size, budget=budget, topk=topk, temperature=temperature)
        outcomes = list(sampling.outcomes(run))
        assert abs(sum(p for _, p in outcomes) - 1) < 1e-12                         # every path, once
        return outcomes

    root = 1
    got = sampling.committed_distribution(round_outcomes, root, horizon)
    step = {last: sampling.softmax(target[last].astype(np.float64) / temperature) for last in range(vocab)}
    for sequence in itertools.product(range(vocab), repeat=horizon):
        previous = (root,) + sequence[:-1]
        expected = np.prod([step[last][token] for last, token in zip(previous, sequence, strict=True)])
        assert abs(got.get(sequence, 0.0) - expected) < 1e-12, (sequence, got.get(sequence), expected)


def test_a_sampled_child_can_be_accepted_where_fixed_children_cannot():
    """Per-node sampling accepts a fixed child with probability p(child); a child drawn from a
    drafter equal to the target is accepted with probability 1 (both enumerated exactly)."""
    target = np.log(np.array([[0.4, 0.3, 0.2, 0.1]] * 4, np.float32))               # [V, V]
    drafter = TableDrafter(target[:, None, :])                                       # q = p, L = 1
    run = functools.partial(sampled_round, target=target, drafter=drafter, last=0, block_size=2, budget=1,
                            topk=1, temperature=1.0)
    sampled = sum(p for tokens, p in sampling.outcomes(run) if len(tokens) == 2)    # a child + the bonus
    fixed = build_tree(0, *top_candidates(drafter.propose([0], 2), 1), 1)            # top-1 child: token 0
    per_node = sum(p for hit, p in sampling.outcomes(
        lambda random: random.choose(1, target[0].astype(np.float64)) == fixed.tokens[1]) if hit)
    assert abs(sampled - 1.0) < 1e-12 and abs(per_node - 0.4) < 1e-6


@pytest.mark.parametrize("temperature", [0.4, 1.0, 3.0])
def test_the_walk_equals_every_nodes_outcome_then_accept(temperature):
    """The kernel's way (every node's outcome at once, then the greedy walk) takes the walk's path."""
    rng = np.random.default_rng(int(temperature * 10))
    vocab, depths = 30, 4
    for seed in range(12):
        draft = (rng.standard_normal((depths, vocab)) * 2).astype(np.float32)
        shape = build_tree(3, *top_candidates(draft, 3), 12)
        random = sampling.KeyedRandom(seed)
        tree = sampling.draw_children(shape, draft, 40, temperature, random)
        logits = (draft[np.minimum(tree.depths, depths - 1)] + rng.standard_normal((tree.size, vocab))
                  ).astype(np.float32)
        walk = sampling.rejection_walk(tree, logits, draft, 40, temperature, random)
        outcomes = sampling.rejection_step(logits, 40 + tree.depths + 1, sampling.child_tokens(tree), draft,
                                           tree.depths, temperature, seed)
        accepted, bonus = accept(tree, outcomes)
        assert_exact(accepted, walk[0])
        assert bonus == walk[1]


def test_children_are_drawn_without_replacement_in_the_trees_shape():
    draft = np.log(np.full((2, 6), 1 / 6, np.float32))
    shape = build_tree(0, *top_candidates(draft, 3), 9)
    tree = sampling.draw_children(shape, draft, 0, 1.0, sampling.KeyedRandom(2))
    assert_exact(tree.parents, shape.parents) and assert_exact(tree.ranks, shape.ranks)
    for node in range(tree.size):
        kids = tree.tokens[tree.children(node)]
        assert np.unique(kids).size == kids.size                                     # siblings distinct
    assert not np.array_equal(tree.tokens, shape.tokens)                             # drawn, not the top-K


def test_generate_ddtree_with_rejection_sampling():
    model, prompt = tiny()
    drafter = make_drafter("ngram", model, prompt, NEW_TOKENS)
    options = {"block_size": 4, "budget": 8, "temperature": 1.0, "seed": 1, "verifier": "rejection"}
    tokens, trace = generate_ddtree(model, prompt, NEW_TOKENS, drafter, **options)
    again, _ = generate_ddtree(model, prompt, NEW_TOKENS, drafter, **options)
    assert_exact(tokens, again)                                                      # keyed: reproducible
    assert tokens.size == NEW_TOKENS == trace.committed_tokens
    assert all(1 <= r.committed <= 4 for r in trace.rounds)


# ------------------------------------------------------------------------------------------- CLI

def test_demo_samples_at_a_temperature(capsys):
    flags = ["--preset", "tiny", "--temperature", "0.8", "--sample-seed", "3", "--tokens", "12",
             "--drafter", "noisy"]
    assert main(["demo", *flags]) == 0
    out = capsys.readouterr().out
    assert "sampling: temperature 0.8, sample seed 3" in out
    ar_line = next(line for line in out.splitlines() if line.startswith("AR "))
    model, prompt = tiny()
    expected = generate_ar(model, prompt, 12, temperature=0.8, seed=3)
    assert ar_line.endswith(" ".join(str(t) for t in expected))
    assert out.rstrip().endswith("DDTree == AR: yes")


@pytest.mark.parametrize("flags, flag", [(["--temperature", "-1"], "--temperature"),
                                         (["--temperature", "nan"], "--temperature"),
                                         (["--temperature", "1", "--sample-seed", "-3"], "--sample-seed")])
def test_demo_refuses_bad_sampling_flags_by_name(capsys, flags, flag):
    assert main(["demo", *flags]) == 2
    err = capsys.readouterr()
    assert f"error: {flag}:" in err.err and "AR " not in err.out                    # before decoding
