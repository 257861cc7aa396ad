"""The engine benchmark: ``python -m kernels.bench engine`` (a GPU only; the simulator is refused).

Every figure side by side, measured in one run on one machine:

- tokens/s of AR and of DDTree (each drafter, block 8, budgets 16/32/64 or ``--budgets``, and
  ``budget="auto"`` with the cost table timed for that drafter at warm-up, budgets up to the
  largest of the grid) for the engine with CUDA graphs, the same engine with graphs off (the same
  buckets and kernels, launched from Python; DDTree at budget 32 only: with every launch from
  Python a run takes seconds), the numpy reference on the CPU (tiny and tiny-b; one worker process
  per configuration, before the GPU part), and transformers' ``DeepseekV3ForCausalLM`` (eager,
  fp32, TF32 off) ``generate`` on the same GPU from the project's own checkpoint (skipped with a
  message when transformers is not installed);
- target forwards per run (prefill included in both decoders), kernel launches per forward;
- each round's time split: draft (the drafter's kernels, or its ``propose`` on the host for the
  "(host)" rows and the "engine, host drafters" runs), top-k, build, verify, accept+compact
  (device time between CUDA events, each phase replayed as its own graph), host (the rest of the
  round's wall time: copies, the wait for the record, Python); and the garbage collector's
  pauses inside the round (``GcPauses``: already counted in draft or host, shown beside them);
- ``small``: the AR step against its floor (the weight bytes one token reads / the read
  bandwidth measured in this run, ``harness.read_batches``), and the verify forward's time against
  the tree's size with the number of distinct experts the tree wakes per MoE layer.

``--engine-only`` keeps the engine with graphs alone (AR, DDTree, launches, the round split): the
second target's DDTree / AR ratios after a kernel change, without the slow columns.

Timing: NEW_TOKENS new tokens after a PROMPT_TOKENS-token prompt; weights uploaded, kernels
compiled and graphs captured (one warm-up run of each configuration) before the clock starts;
the median of ``--repeats`` runs (REPEATS unless given), each row saying how many. The results go
to a markdown report and a JSON file (chapter 14 draws from it).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import gc
import json
import math
import pathlib
import shlex
import statistics
import sys
import tempfile
import time

import numpy as np

from ddtree import decode as reference_decode
from ddtree import golden
from ddtree.budget import cost_table_to_dict
from ddtree.cli import budget_list
from ddtree.config import ModelConfig, preset
from ddtree.drafters import DRAFTERS, make_drafter
from ddtree.model import Transformer as ReferenceTransformer
from ddtree.weights import init_weights, save_pretrained, weight_shapes
from kernels import decode as engine_decode
from kernels import device
from kernels.bench.environment import versions
from kernels.bench.harness import READ_BATCH, counting_launches, read_batches
from kernels.model import DEFAULT_MAX_TREE_NODES

PRESETS = ("tiny", "tiny-b", "small")
HOST_PRESETS = ("tiny", "tiny-b")      # small's weights are made on the GPU; numpy would take minutes a token
BUDGETS = (16, 32, 64)
AUTO = "auto"                          # the cost-aware budget (ddtree.budget), a row beside the grid's
CARRIED = "auto, carried"              # the same, each run starting from the statistics of the run before
MAX_BUDGET = DEFAULT_MAX_TREE_NODES - 1  # the engine's largest tree: the grid's limit
BLOCK = 8
NEW_TOKENS = 256
PROMPT_TOKENS = 8
REPEATS = 5
NO_GRAPH_REPEATS = 1                   # graphs-off rows: every launch from Python, seconds a run; one
                                       # run each keeps the whole record inside one 10-minute command
READ_BYTES = 1 << 30                   # the read bandwidth's buffer (the AR step's floor)
SPLIT_BUDGET = 32                      # the round split is measured at this budget
TREE_SIZES = (1, 2, 3, 4, 8, 16, 32, 64)  # small: verify time against tree nodes
VERIFY_TARGET_NODES = (2, 3, 4, 8)     # small: the trees whose verify the target holds to its floor
VERIFY_TARGET, AR_TARGET = 1.4, 1.5    # ... at most this many times it, and the AR step its own
# tok/s the engine with graphs should reach at budget auto (AR: its own row), per preset and decoder;
# and budget auto's least ratio to AR, per preset and drafter, where above AUTO_AR_FLOOR
AUTO_RATE_TARGETS = {"small": {"AR": 700, "DDTree noisy": 800, "DDTree oracle": 1800}}
AUTO_AR_TARGETS = {"tiny": {"DDTree noisy": 3.0}, "tiny-b": {"DDTree noisy": 3.0}}
AUTO_AR_FLOOR = 0.98                   # budget auto: never slower than AR, within the timing's spread
DRAFTER_SHARPNESS = 4.0                # random drafter logits ~ N(0, 4^2) for the tree-size sweep
PHASES = ("draft", "top-k", "build", "verify", "accept+compact", "host")
GC = "gc"                              # the garbage collector's pauses inside the round (in draft or host)


def median_rate(run, tokens: int, repeats: int):
    """(median tokens/s of ``repeats`` calls of ``run``, the last call's result); wall clock, and
    ``run`` waits for its result. Warm-up calls, where one is needed, come before."""
    seconds, result = [], None
    for _ in range(repeats):
        begin = time.perf_counter()
        result = run()
        seconds.append(time.perf_counter() - begin)
    return tokens / statistics.median(seconds), result


def prompt_for(name: str, config: ModelConfig) -> np.ndarray:
    if name in golden.DEFAULT_PROMPTS:
        return golden.default_prompt(name)
    return np.random.default_rng(0).integers(0, config.vocab_size, PROMPT_TOKENS).astype(np.int64)


class TimedDrafter:
    """Any drafter, with the seconds its ``propose`` calls took (the round's draft share)."""

    def __init__(self, drafter):
        self.drafter, self.seconds = drafter, 0.0

    def propose(self, context, block_size):
        begin = time.perf_counter()
        logits = self.drafter.propose(context, block_size)
        self.seconds += time.perf_counter() - begin
        return logits


class GcPauses:
    """Seconds the garbage collector ran inside the block (``gc.callbacks``), and how many times:
    ``with GcPauses() as pauses: ...; pauses.seconds, pauses.collections``."""

    def __init__(self):
        self.seconds, self.collections, self.started = 0.0, 0, 0.0

    def _callback(self, phase, info):
        if phase == "start":
            self.started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self.started
            self.collections += 1

    def __enter__(self):
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._callback)


class RandomDrafter:
    """Peaked random logits: full, deep trees whatever the context (the tree-size sweep)."""

    def __init__(self, vocab: int, seed: int = 0):
        self.vocab, self.rng = vocab, np.random.default_rng(seed)

    def propose(self, context, block_size):
        return self.rng.normal(0.0, DRAFTER_SHARPNESS, (block_size - 1, self.vocab)).astype(np.float32)


@dataclasses.dataclass
class Run:
    system: str            # "engine, graphs", "engine, no graphs", "numpy (CPU)", "transformers eager"
    decoder: str           # "AR" or "DDTree <drafter>"
    budget: int | str | None   # an integer, "auto" or None (AR)
    tokens_per_second: float
    forwards: int          # target forwards per run, prefill included
    repeats: int           # timed runs tokens_per_second is the median of


def ar_runs(system: str, generate, model, prompt, repeats: int, warm_up: bool) -> Run:
    def run():
        before = model.forward_count
        generate(model, prompt, NEW_TOKENS)
        return model.forward_count - before
    if warm_up:
        run()                                                             # compile, capture
    rate, forwards = median_rate(run, NEW_TOKENS, repeats)
    return Run(system, "AR", None, rate, forwards, repeats)


def ddtree_runs(system: str, generate, model, prompt, continuation, repeats: int, warm_up: bool,
                drafters=DRAFTERS, budgets=BUDGETS) -> list[Run]:
    runs = []
    for drafter_name in drafters:
        for budget in budgets:
            run = functools.partial(ddtree_run, system, generate, model, prompt, continuation, drafter_name,
                                    budget)
            if warm_up:
                run()                                                     # compile, capture
            rate, trace = median_rate(run, NEW_TOKENS, repeats)
            runs.append(Run(system, f"DDTree {drafter_name}", budget, rate,
                            trace.prefill_forwards + trace.verify_forwards, repeats))
    return runs


def ddtree_run(system, generate, model, prompt, continuation, drafter_name, budget, cost_table=None,
               acceptance=None):
    """One timed DDTree generation (the drafter is made inside: the oracles read the continuation)."""
    drafter = make_drafter(drafter_name, model, prompt, NEW_TOKENS, continuation=continuation)
    tokens, trace = generate(model, prompt, NEW_TOKENS, drafter, block_size=BLOCK, budget=budget,
                             cost_table=cost_table, acceptance=acceptance)
    if not np.array_equal(tokens, continuation):
        raise AssertionError(f"{system} DDTree[{drafter_name}, budget {budget}] != AR")
    return trace


def auto_runs(model, prompt, continuation, repeats: int, max_budget: int,
              drafters=DRAFTERS) -> tuple[list[Run], dict]:
    """The engine with graphs at ``budget="auto"``, per drafter: its cost table timed at warm-up
    with that drafter (``kernels.decode.measure_cost_table``, budgets 0..``max_budget``, rounds
    queued as a generation queues them), one untimed run (graphs of the budgets it picks), then the
    timed runs, each from empty statistics; then ``CARRIED``: timed runs that each start from the
    statistics the run before ended with (``acceptance=``, as a server keeps them across requests),
    the first from the last run's. Returns the runs and, per drafter, its table and the budgets the
    last run from empty statistics chose."""
    runs, chosen = [], {}
    for drafter_name in drafters:
        drafter = make_drafter(drafter_name, model, prompt, NEW_TOKENS, continuation=continuation)
        table = engine_decode.measure_cost_table(model, prompt, drafter, BLOCK, max_budget=max_budget,
                                                 repeats=repeats)
        run = functools.partial(ddtree_run, "engine, graphs", engine_decode.generate_ddtree, model, prompt,
                                continuation, drafter_name, AUTO, cost_table=table)
        run()                                                             # capture the chosen sizes
        rate, trace = median_rate(run, NEW_TOKENS, repeats)
        runs.append(Run("engine, graphs", f"DDTree {drafter_name}", AUTO, rate,
                        trace.prefill_forwards + trace.verify_forwards, repeats))
        chosen[drafter_name] = {"cost_table": cost_table_to_dict(table),
                                "budgets": [int(b) for b in trace.budgets]}
        rate, trace = median_rate(functools.partial(carried_run, run, [trace]), NEW_TOKENS, repeats)
        runs.append(Run("engine, graphs", f"DDTree {drafter_name}", CARRIED, rate,
                        trace.prefill_forwards + trace.verify_forwards, repeats))
    return runs, chosen


def carried_run(run, traces: list):
    """``run`` from the statistics the last of ``traces`` ended with; its trace joins them."""
    traces.append(run(acceptance=traces[-1].acceptance))
    return traces[-1]


def numpy_task(task) -> dict:
    """One numpy measurement (run in a worker process): AR, or DDTree with one drafter and budget."""
    name, decoder, budget, repeats = task
    config = preset(name)
    model = ReferenceTransformer(config, init_weights(config, golden.WEIGHT_SEED))
    prompt = prompt_for(name, config)
    continuation = reference_decode.generate_ar(model, prompt, NEW_TOKENS)
    if decoder == "AR":                            # numpy compiles nothing: no warm-up
        run = ar_runs("numpy (CPU)", reference_decode.generate_ar, model, prompt, repeats, warm_up=False)
    else:
        [run] = ddtree_runs("numpy (CPU)", reference_decode.generate_ddtree, model, prompt, continuation,
                            repeats, warm_up=False, drafters=(decoder.split()[1],), budgets=(budget,))
    return {"preset": name, "run": dataclasses.asdict(run), "tokens": continuation.tolist()}


def numpy_runs(names, repeats: int, log, budgets=BUDGETS) -> dict[str, list]:
    """The numpy reference on the CPU for every host preset, its measurements in parallel worker
    processes (one per configuration; started before the GPU is touched), so they cost the run
    seconds, not minutes. Each worker is single-threaded, as the reference is."""
    import concurrent.futures
    import multiprocessing
    import os

    tasks = [(name, "AR", None, repeats) for name in names]
    tasks += [(name, f"DDTree {drafter}", budget, repeats) for name in names for drafter in DRAFTERS
              for budget in budgets]
    workers = max(1, min(len(tasks), (os.cpu_count() or 2) - 2))
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        results = list(pool.map(numpy_task, tasks))
    log(f"numpy: {len(tasks)} measurements on {workers} worker processes")
    by_preset = {name: [] for name in names}
    for result in results:
        by_preset[result["preset"]].append(result)
    return by_preset


def launches_per_forward(model, prompt) -> dict[str, int]:
    """Kernel launches of one AR step and of one DDTree round (graphs off: every launch counted)."""
    enabled, model.graphs.enabled = model.graphs.enabled, False
    try:
        cache = model.new_cache()
        model.prefill(cache, prompt, emit_token=True)
        with counting_launches() as count:
            model.ar_step(cache)
        ar = count[0]
        drafter = make_drafter("ngram", model, prompt, NEW_TOKENS)
        cache = model.new_cache()
        model.prefill(cache, prompt[:-1], emit_token=False)
        with counting_launches() as count:
            engine_decode.ddtree_round(model, cache, prompt, drafter, BLOCK, SPLIT_BUDGET, None)
        return {"AR step": ar, f"DDTree round (budget {SPLIT_BUDGET})": count[0]}
    finally:
        model.graphs.enabled = enabled


def round_split(model, prompt, continuation) -> dict[str, dict[str, float]]:
    """Mean microseconds per round of each phase, per drafter, at budget SPLIT_BUDGET, with the
    drafter's kernels in the round (its "draft" phase, device time) and, keyed "<drafter> (host)",
    with ``device_drafters`` off (its ``propose`` calls on the host, timed)."""
    split = {}
    for drafter_name in DRAFTERS:
        for on_device in (True, False):
            model.device_drafters = on_device
            key = drafter_name if on_device else f"{drafter_name} (host)"
            split[key] = drafter_split(model, prompt, continuation, drafter_name)
    model.device_drafters = True
    return split


def drafter_split(model, prompt, continuation, drafter_name) -> dict[str, float]:
    """One drafter's round split: the second of two runs (the first captures every phase's graphs,
    so the timed run replays them all)."""
    model.round_timings = {}                      # a first run captures each phase's graphs (its
    engine_decode.generate_ddtree(                # first use of a key runs the launches from Python)
        model, prompt, NEW_TOKENS, make_drafter(drafter_name, model, prompt, NEW_TOKENS,
                                                continuation=continuation),
        block_size=BLOCK, budget=SPLIT_BUDGET)
    drafter = make_drafter(drafter_name, model, prompt, NEW_TOKENS, continuation=continuation)
    timed = None if model.device_drafters else TimedDrafter(drafter)
    model.round_timings = {}
    begin = time.perf_counter()
    with GcPauses() as pauses:
        _, trace = engine_decode.generate_ddtree(model, prompt, NEW_TOKENS, timed or drafter,
                                                 block_size=BLOCK, budget=SPLIT_BUDGET)
    wall = time.perf_counter() - begin
    phases, model.round_timings = model.round_timings, None
    if timed is not None:
        phases["draft"] = timed.seconds
    phases["host"] = wall - sum(phases.values())
    phases[GC] = pauses.seconds
    rounds = trace.verify_forwards
    return {**{name: 1e6 * phases[name] / rounds for name in (*PHASES, GC)}, "rounds": rounds,
            "collections": pauses.collections}


def weight_bytes_per_token(config: ModelConfig) -> int:
    """Bytes of weights one decode token reads: every attention and norm weight, the dense MLP,
    per MoE layer the router, the shared expert and k of the E routed experts, one embedding row
    and the whole lm_head."""
    total = 0
    for name, shape in weight_shapes(config).items():
        size = math.prod(shape)
        if ".mlp.experts." in name:
            size = size * config.num_experts_per_tok // config.n_routed_experts
        elif name == "model.embed_tokens.weight":
            size = shape[1]
        total += size
    return 4 * total


def expert_bytes(config: ModelConfig) -> int:
    """Bytes of one routed expert's three matrices in every MoE layer (float32)."""
    layers = sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
    return 4 * layers * 3 * config.hidden_size * config.moe_intermediate_size


def verify_floor_bytes(config: ModelConfig, experts_per_layer: float) -> float:
    """Bytes of weights a verify reads at the least: a decode token's, with its k routed experts per
    MoE layer replaced by the tree's distinct experts (each read at least once)."""
    extra = experts_per_layer - config.num_experts_per_tok
    return weight_bytes_per_token(config) + extra * expert_bytes(config)


def verify_floor_us(config: ModelConfig, row: dict, floor: dict) -> float:
    """The floor of a tree-size row's verify: its bytes at the run's read bandwidth, in µs."""
    return 1e6 * verify_floor_bytes(config, row["experts_per_layer"]) / floor["read_bandwidth"]


def floor_targets(config: ModelConfig, floor: dict, tree_sizes: list[dict]) -> list[str]:
    """The AR step against its floor (at most AR_TARGET times it) and the verify of each tree of
    VERIFY_TARGET_NODES nodes the sweep measured against its own (at most VERIFY_TARGET times)."""
    def line(what: str, ratio: float, target: float) -> str:
        verdict = "met" if ratio <= target else "missed"
        return f"{what} / its floor: {ratio:.2f} (target <= {target}: {verdict})"

    lines = [line("AR step", floor["ar_step_us"] / floor["floor_us"], AR_TARGET)]
    lines += [line(f"verify of {row['nodes']} nodes", row["verify_us"] / verify_floor_us(config, row, floor),
                   VERIFY_TARGET) for row in tree_sizes if row["nodes"] in VERIFY_TARGET_NODES]
    return lines


def tree_size_sweep(model, prompt, repeats: int) -> list[dict]:
    """Verify time (device; the median of ``repeats`` rounds) against tree nodes, with the distinct
    experts the tree wakes."""
    c, rows = model.config, []
    moe_layers = [i for i in range(c.num_hidden_layers) if c.is_moe_layer(i)]
    for nodes in TREE_SIZES:
        budget = nodes - 1
        block = max(2, min(BLOCK, nodes))              # deep enough to hold a budget of nodes - 1
        drafter = RandomDrafter(c.vocab_size)
        cache = model.new_cache()
        model.prefill(cache, prompt[:-1], emit_token=False)
        context = np.array(prompt)
        engine_decode.ddtree_round(model, cache, context, drafter, block, budget, None)   # warm-up
        times, woken = [], []
        for _ in range(repeats):
            cache = model.new_cache()
            model.prefill(cache, prompt[:-1], emit_token=False)
            model.round_timings = {}
            record = engine_decode.ddtree_round(model, cache, context, drafter, block, budget, None)
            times.append(model.round_timings["verify"])
            model.round_timings = None
            woken.append(np.mean([np.unique(model.moe_scratch[layer].ids.copy_to_host()[:record.tokens.size]).size
                                  for layer in moe_layers]))
        rows.append({"nodes": nodes, "verify_us": 1e6 * statistics.median(times), "rounds": repeats,
                     "experts_per_layer": float(np.mean(woken))})
    return rows


def load_transformers():
    """(torch, transformers) with TF32 off (``peers.torch_or_none``), or None and why not."""
    from kernels.bench import peers

    torch = peers.torch_or_none()
    if torch is None:
        return None, "torch with CUDA is not available here: the peer column is skipped"
    try:
        import transformers
    except ImportError as error:
        return None, f"transformers not installed ({error}): the peer column is skipped"
    return (torch, transformers), None


def load_deepseek(modules, directory, where: str):
    """transformers' ``DeepseekV3ForCausalLM`` from a checkpoint directory, fp32, eager attention
    and experts (no fused kernel of its own choosing), in eval mode on ``where``. A tensor missing,
    unexpected or of another shape is refused: transformers would fill it with random numbers."""
    torch, transformers = modules
    kwargs = dict(attn_implementation="eager", dtype=torch.float32, output_loading_info=True)
    if hasattr(transformers.PreTrainedModel, "set_experts_implementation"):
        kwargs["experts_implementation"] = "eager"
    hf_model, info = transformers.DeepseekV3ForCausalLM.from_pretrained(str(directory), **kwargs)
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        if info.get(kind):
            raise ValueError(f"transformers reports {kind} loading {directory}: {sorted(info[kind])[:5]}")
    return hf_model.to(where).eval()


def transformers_rate(modules, config, weights, prompt, expected, repeats: int) -> tuple[float, bool]:
    """transformers' DeepseekV3ForCausalLM (eager, fp32, TF32 off) generate from our checkpoint."""
    torch, transformers = modules                                  # TF32 off: load_transformers
    with tempfile.TemporaryDirectory() as directory:
        save_pretrained(directory, config, weights)
        hf_model = load_deepseek(modules, directory, "cuda")
    ids = torch.as_tensor(prompt, dtype=torch.long, device="cuda")[None]

    def generate():
        with torch.no_grad():
            out = hf_model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                    do_sample=False, eos_token_id=None, pad_token_id=0)
        torch.cuda.synchronize()
        return out[0, prompt.size:].cpu().numpy()

    same = bool(np.array_equal(generate(), expected))        # also the warm-up
    rate, _ = median_rate(generate, NEW_TOKENS, repeats)
    hf_model.to("cpu")
    torch.cuda.empty_cache()
    return rate, same


def host_weights(weights: dict) -> dict:
    return {name: w if isinstance(w, np.ndarray) else w.copy_to_host() for name, w in weights.items()}


def log_runs(runs, log) -> None:
    for r in runs:
        log(f"  {r.system:18s} {r.decoder:14s} budget {r.budget or '-':>3}: "
            f"{r.tokens_per_second:8.0f} tok/s, {r.forwards} forwards")


def preset_weights(name: str) -> dict:
    """The benchmark's weights of a preset (seed ``golden.WEIGHT_SEED``): numpy's for the
    HOST_PRESETS (the golden bundles' own), made on the device for the rest."""
    from kernels.weights import init_weights as device_init_weights

    if name in HOST_PRESETS:
        return init_weights(preset(name), golden.WEIGHT_SEED)
    weights = device_init_weights(preset(name), golden.WEIGHT_SEED)
    device.cuda.synchronize()
    return weights


def bench_preset(name: str, repeats: int, peers, numpy_results: list, log, engine_only: bool = False,
                 budgets=BUDGETS) -> dict:
    from kernels.model import Transformer

    config = preset(name)
    begin = time.perf_counter()
    weights = preset_weights(name)
    made = time.perf_counter() - begin
    model = Transformer(config, weights)
    prompt = prompt_for(name, config)
    log(f"{name}: weights made in {made:.1f} s ({'host' if name in HOST_PRESETS else 'GPU'})")
    result = {"preset": name, "weights_seconds": made, "runs": []}

    continuation = engine_decode.generate_ar(model, prompt, NEW_TOKENS)
    runs = [ar_runs("engine, graphs", engine_decode.generate_ar, model, prompt, repeats, warm_up=True)]
    runs += ddtree_runs("engine, graphs", engine_decode.generate_ddtree, model, prompt, continuation, repeats,
                        warm_up=True, budgets=budgets)
    auto, result["auto"] = auto_runs(model, prompt, continuation, repeats, max(budgets))
    runs += auto
    model.device_drafters = False                 # each drafter's propose on the host, as the reference's
    runs += ddtree_runs("engine, host drafters", engine_decode.generate_ddtree, model, prompt, continuation,
                        repeats, warm_up=True, budgets=(SPLIT_BUDGET,))
    model.device_drafters = True
    log_runs(runs, log)
    if not engine_only:
        model.graphs.enabled = False              # the same buckets and kernels, launched from Python
        slow = min(repeats, NO_GRAPH_REPEATS)
        off = [ar_runs("engine, no graphs", engine_decode.generate_ar, model, prompt, slow, warm_up=False)]
        off += ddtree_runs("engine, no graphs", engine_decode.generate_ddtree, model, prompt, continuation,
                           slow, warm_up=False, budgets=(SPLIT_BUDGET,))
        model.graphs.enabled = True
        log_runs(off, log)
        runs += off
    result["launches"] = launches_per_forward(model, prompt)
    result["split"] = round_split(model, prompt, continuation)
    log(f"  launches {result['launches']}; split {result['split']}")
    for measured in numpy_results:
        if measured["run"]["decoder"] == "AR" and measured["tokens"] != continuation.tolist():
            raise AssertionError(f"{name}: the engine's AR tokens differ from numpy's")
        runs.append(Run(**measured["run"]))
    if name not in HOST_PRESETS:
        result["floor"] = ar_floor(config, 1 / runs[0].tokens_per_second, runs[0].repeats,
                                   read_batches(READ_BYTES, quick=False))
        result["tree_sizes"] = tree_size_sweep(model, prompt, repeats)
        log(f"  floor {result['floor']}; tree sizes {result['tree_sizes']}")
    result["runs"] = [dataclasses.asdict(r) for r in runs]
    del model
    from kernels.bench import peers as torch_peers
    if not engine_only and torch_peers.available():    # torch with TF32 off; transformers not needed
        from kernels.bench.torch_peer import peer_rate
        rate, same = peer_rate(config, weights, prompt, continuation, repeats)
        forwards = prompt.size + NEW_TOKENS - 1          # the prompt runs row by row through the graph
        result["runs"].append(dataclasses.asdict(Run("PyTorch, CUDA graph", "AR", None, rate, forwards,
                                                     repeats)))
        result["torch_peer_same_tokens"] = same
        log(f"  PyTorch, CUDA graph: {rate:.0f} tok/s (same tokens: {same})")
    if peers is not None:
        rate, same = transformers_rate(peers, config, host_weights(weights), prompt, continuation, repeats)
        result["runs"].append(dataclasses.asdict(Run("transformers eager", "AR", None, rate, NEW_TOKENS,
                                                     repeats)))
        result["transformers_same_tokens"] = same
        log(f"  transformers: {rate:.0f} tok/s (same tokens: {same})")
    return result


def ar_floor(config: ModelConfig, ar_step_seconds: float, ar_step_runs: int, read_seconds: list) -> dict:
    """The AR step (the median of ``ar_step_runs`` generations) against its floor: the weight bytes
    one token reads over the read bandwidth, from ``read_seconds`` = ``read_batches(READ_BYTES)``
    measured now (a read-only kernel over 1 GiB, seconds per pass of each batch of READ_BATCH
    passes back to back): the median batch, and the slowest and fastest batch as the spread."""
    bandwidths = sorted(READ_BYTES / seconds for seconds in read_seconds)
    bandwidth = statistics.median(bandwidths)
    weight_bytes = weight_bytes_per_token(config)
    return {"read_bandwidth": bandwidth, "read_bandwidth_spread": [bandwidths[0], bandwidths[-1]],
            "read_batches": len(bandwidths), "floor_us": 1e6 * weight_bytes / bandwidth,
            "ar_step_us": 1e6 * ar_step_seconds, "ar_step_runs": ar_step_runs,
            "weight_bytes_per_token": weight_bytes}


def floor_only(name: str, repeats: int, log) -> dict:
    """The AR step against its floor and verify time against tree size, without the tok/s grid
    (``--floor-only``: what ``small`` needs, in minutes instead of an hour). AR: the median of
    ``repeats`` timed generations of NEW_TOKENS tokens after a warm-up one."""
    from kernels.model import Transformer
    from kernels.weights import init_weights as device_init_weights

    config = preset(name)
    begin = time.perf_counter()
    weights = device_init_weights(config, golden.WEIGHT_SEED)
    device.cuda.synchronize()
    log(f"{name}: weights made in {time.perf_counter() - begin:.1f} s (GPU)")
    model = Transformer(config, weights)
    prompt = prompt_for(name, config)
    ar = ar_runs("engine, graphs", engine_decode.generate_ar, model, prompt, repeats, warm_up=True)
    result = {"preset": name, "floor": ar_floor(config, 1 / ar.tokens_per_second, repeats,
                                                read_batches(READ_BYTES, quick=False))}
    log(f"  floor {result['floor']}")
    result["tree_sizes"] = tree_size_sweep(model, prompt, repeats)
    log(f"  tree sizes {result['tree_sizes']}")
    return result


def targets(result: dict) -> list[str]:
    """A preset's targets, each as measured: engine AR / transformers >= 5 and / the PyTorch peer
    >= 1; DDTree / engine AR >= 0.8 x (AR forwards / DDTree forwards) at a fixed budget, and
    >= AUTO_AR_FLOOR at budget auto (more for the drafters of AUTO_AR_TARGETS), and the tok/s of
    AUTO_RATE_TARGETS."""
    runs, name = result["runs"], result["preset"]
    engine_ar = next(r for r in runs if r["system"] == "engine, graphs" and r["decoder"] == "AR")
    lines = []
    peer = [r for r in runs if r["system"] == "transformers eager"]
    if peer:
        ratio = engine_ar["tokens_per_second"] / peer[0]["tokens_per_second"]
        verdict = "met" if ratio >= 5 else "missed"
        lines.append(f"engine AR / transformers eager: {ratio:.1f}x (target >= 5x: {verdict})")
    graph_peer = [r for r in runs if r["system"] == "PyTorch, CUDA graph"]
    if graph_peer:
        ratio = engine_ar["tokens_per_second"] / graph_peer[0]["tokens_per_second"]
        same = "yes" if result.get("torch_peer_same_tokens") else "no"
        lines.append(f"engine AR / PyTorch, CUDA graph: {ratio:.2f}x (target >= 1.0x: "
                     f"{'met' if ratio >= 1 else 'missed'}; the engine's tokens: {same})")
    for r in runs:
        if r["system"] == "engine, graphs" and r["decoder"] != "AR":
            speed = r["tokens_per_second"] / engine_ar["tokens_per_second"]
            if r["budget"] in (AUTO, CARRIED):
                least = AUTO_AR_TARGETS.get(name, {}).get(r["decoder"], AUTO_AR_FLOOR)
                verdict = "met" if speed >= least else "missed"
                lines.append(f"{r['decoder']}, budget {r['budget']}: DDTree/AR {speed:.2f} "
                             f"(target >= {least}: {verdict})")
                continue
            needed = 0.8 * engine_ar["forwards"] / r["forwards"]
            verdict = "met" if speed >= needed else "missed"
            lines.append(f"{r['decoder']}, budget {r['budget']}: DDTree/AR {speed:.2f} vs 0.8 x forwards "
                         f"ratio {needed:.2f} ({verdict})")
    for decoder, rate in AUTO_RATE_TARGETS.get(name, {}).items():
        row = next((r for r in runs if r["system"] == "engine, graphs" and r["decoder"] == decoder
                    and r["budget"] == (None if decoder == "AR" else AUTO)), None)
        if row is not None:
            which = "AR" if decoder == "AR" else f"{decoder}, budget auto"
            lines.append(f"{which}: {row['tokens_per_second']:.0f} tok/s (target >= {rate}: "
                         f"{'met' if row['tokens_per_second'] >= rate else 'missed'})")
    return lines


def section(name: str, lines: list[str]) -> list[str]:
    """``lines`` between snippet markers, so the site includes the record's tables by name."""
    return [f"<!-- --8<-- [start:{name}] -->", *lines, f"<!-- --8<-- [end:{name}] -->"]


def format_report(results: list[dict], header: list, command: str) -> str:
    """The markdown record; each preset's tables are snippet sections (engine-, targets-, split-,
    floor-<preset>) for the site."""
    lines = ["# Engine benchmark", "", f"Command: `{command}`", ""]
    lines += [f"- {key}: {value}" for key, value in header]
    if any(result.get("runs") for result in results):
        lines += ["", f"{NEW_TOKENS} new tokens after a {PROMPT_TOKENS}-token prompt, block {BLOCK}; tok/s: "
                  f"the median of the row's runs, after a warm-up run (compiled, graphs captured) where "
                  f"the system compiles. Forwards: target forwards per run, prefill included."]
    lines.append("")
    for result in results:
        name = result["preset"]
        lines += [f"## {name}", ""]
        if result.get("runs"):
            table = ["| system | decoder | budget | tok/s | runs | forwards | tokens per forward |",
                     "|---|---|---|---|---|---|---|"]
            for r in result["runs"]:
                rate, forwards = r["tokens_per_second"], r["forwards"]
                table.append(f"| {r['system']} | {r['decoder']} | {r['budget'] or '-'} | {rate:.0f} | "
                             f"{r['repeats']} | {forwards} | {NEW_TOKENS / forwards:.2f} |")
            lines += section(f"engine-{name}", table)
            verdicts = [f"- {line}" for line in targets(result)]
            if "transformers_same_tokens" in result:
                verdicts.append(f"- transformers generated the engine's tokens: "
                                f"{'yes' if result['transformers_same_tokens'] else 'no'}")
            lines += ["", "Targets:", ""] + section(f"targets-{name}", verdicts)
        if result.get("auto"):
            chosen = ["| drafter | rounds | budgets chosen (rounds at each) | table: AR step µs "
                      "| switch µs |", "|---|---|---|---|---|"]
            for drafter_name, auto in result["auto"].items():
                counts = collections.Counter(auto["budgets"])
                table = auto["cost_table"]
                chosen.append(f"| {drafter_name} | {len(auto['budgets'])} | "
                              + ", ".join(f"{b} x{counts[b]}" for b in sorted(counts))
                              + f" | {table['ar_step'] * 1e6:.0f} | {table.get('switch', 0.0) * 1e6:.0f} |")
            lines += ["", f"Budget auto: each drafter's cost table timed at warm-up (budgets 0 to "
                      f"{len(next(iter(result['auto'].values()))['cost_table']['verify'])}; 0 is an AR "
                      "step); the budgets its last timed run chose:", ""] + section(f"auto-{name}", chosen)
        if "launches" in result:
            lines += ["", "Kernel launches: " + ", ".join(f"{k} {v}" for k, v in result["launches"].items())]
        if "split" in result:
            split = ["| drafter | rounds | " + " | ".join(PHASES) + " | gc (of draft + host) |",
                     "|---" * (len(PHASES) + 3) + "|"]
            split += [f"| {drafter_name} | {row['rounds']} | " + " | ".join(f"{row[p]:.0f}" for p in PHASES)
                      + (f" | {row[GC]:.0f} ({row['collections']} collections) |" if GC in row else " | - |")
                      for drafter_name, row in result["split"].items()]
            lines += ["", f"Round split at budget {SPLIT_BUDGET} (µs per round; device phases between CUDA "
                      "events):", ""] + section(f"split-{name}", split)
        if "floor" in result:
            f = result["floor"]
            low, high = f["read_bandwidth_spread"]
            floor = [f"AR step: {f['ar_step_us']:.0f} µs (the median of {f['ar_step_runs']} generations); "
                     f"floor {f['floor_us']:.0f} µs ({f['weight_bytes_per_token'] / 1e9:.2f} GB of weights "
                     f"per token at {f['read_bandwidth'] / 1e9:.0f} GB/s read bandwidth measured in this "
                     f"run: `read_kernel` over {READ_BYTES >> 30} GiB, the median of {f['read_batches']} "
                     f"batches of {READ_BATCH} passes back to back; batches {low / 1e9:.0f} to "
                     f"{high / 1e9:.0f} GB/s): {f['ar_step_us'] / f['floor_us']:.1f}x the floor", "",
                     "| tree nodes | verify µs | its floor µs | x floor | rounds | distinct experts per MoE "
                     "layer |", "|---|---|---|---|---|---|"]
            config = preset(name)
            for row in result["tree_sizes"]:
                low_us = verify_floor_us(config, row, f)
                floor.append(f"| {row['nodes']} | {row['verify_us']:.0f} | {low_us:.0f} | "
                             f"{row['verify_us'] / low_us:.2f} | {row['rounds']} | "
                             f"{row['experts_per_layer']:.1f} |")
            verdicts = floor_targets(config, f, result["tree_sizes"])
            floor += ["", "Targets:", ""] + [f"- {line}" for line in verdicts]
            lines += [""] + section(f"floor-{name}", floor)
        lines.append("")
    return "\n".join(lines)


def write_record(path, results: list[dict], header: list, command: str) -> str:
    """The markdown report at ``path`` and the measurements as JSON beside it; returns the report."""
    report = format_report(results, header, command)
    if path:
        path.write_text(report)
        path.with_suffix(".json").write_text(json.dumps({"header": header, "command": command,
                                                         "results": results}, indent=1))
    return report


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m kernels.bench engine",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default=",".join(PRESETS), help="comma-separated presets")
    parser.add_argument("--repeats", type=int, default=REPEATS,
                        help="timed runs each tok/s (and the floor's AR step, and each tree size's "
                             "verify time) is the median of")
    parser.add_argument("--budgets", type=budget_list, default=BUDGETS,
                        help="the DDTree grid's budgets, e.g. 1,2,4,8,16,32,64 (budget auto's table spans "
                             "1 to the largest)")
    parser.add_argument("--floor-only", action="store_true",
                        help="only the AR step against its floor and verify time against tree size")
    parser.add_argument("--engine-only", action="store_true",
                        help="only the engine with graphs (AR, DDTree, launches, the round split): no "
                             "graphs-off, numpy or transformers columns")
    parser.add_argument("--no-numpy", action="store_true",
                        help="leave out the numpy reference on the CPU (its speed does not depend on the "
                             "GPU's kernels; its ngram runs take minutes): every other column stays")
    parser.add_argument("--out", type=pathlib.Path,
                        help="write the markdown report here (and a .json beside it)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.budgets[-1] > MAX_BUDGET:
        parser.error(f"--budgets must be at most {MAX_BUDGET} (the engine's largest tree, "
                     f"kernels.model.DEFAULT_MAX_TREE_NODES - 1), got {args.budgets[-1]}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if device.SIMULATOR:
        print("error: the engine benchmark needs a GPU (the CUDA simulator's times mean nothing)",
              file=sys.stderr)
        return 2
    names = [n for n in args.presets.split(",") if n]
    for n in names:
        preset(n)                                              # unknown names fail before any work
    log = lambda text: print(text, file=sys.stderr, flush=True)
    command = "python -m kernels.bench engine " + shlex.join(argv if argv is not None else sys.argv[1:])
    if args.floor_only:
        print(write_record(args.out, [floor_only(n, args.repeats, log) for n in names], versions(), command))
        return 0
    on_host = [] if args.engine_only or args.no_numpy else [n for n in names if n in HOST_PRESETS]
    numpy_results = numpy_runs(on_host, args.repeats, log, args.budgets) if on_host else {}
    peers, missing = (None, "") if args.engine_only else load_transformers()
    if missing:
        log(f"note: {missing}")
    header = versions()
    if peers is not None:
        header.append(("peer", f"torch {peers[0].__version__}, transformers {peers[1].__version__}"))
    results = []
    for n in names:                               # the report is rewritten after every preset
        results.append(bench_preset(n, args.repeats, peers, numpy_results.get(n, []), log, args.engine_only,
                                    args.budgets))
        report = write_record(args.out, results, header, command)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
