"""Chapter 14: the device-resident engine, one DDTree round as the data flows through it.

``kernels.model.Transformer`` keeps the weights, the latent KV cache and every activation on the
device, and runs a whole round (top-K, tree build, verify forward, argmax, accept, compaction) as
launches that read every per-step value from device buffers, so that one CUDA graph per shape
replays them. This chapter runs one round on ``micro`` (in the CUDA simulator without a GPU, where
the same code launches directly) and prints every kernel launch in order with its grid, block and
the shapes it reads and writes; then what crosses the bus per round, in bytes; then the results
measured on the GPU (tokens/s of the engine with and without graphs, PyTorch, transformers; a
round's cost in AR steps; the round's time split), read from the committed engine record
docs/results/engine.json (its header names the GPU).

Run: .venv/bin/python walkthrough/14_engine.py

Writes docs/assets/figures/14_engine_report.txt, 14_engine_tokens.png and 14_engine_split.png.
"""

import contextlib
import json

import chapter  # walkthrough/chapter.py: figures, the report file, the Agg backend
import matplotlib.pyplot as plt
import matplotlib.ticker
import numpy as np
from matplotlib.ticker import NullFormatter

import kernels  # noqa: F401  (picks GPU or simulator before numba loads)
from ddtree import decode as reference_decode
from ddtree.config import preset
from ddtree.drafters import make_drafter
from ddtree.tree import tree_size
from kernels import decode as engine_decode
from kernels.bench.engine import expert_bytes
from kernels.device import SIMULATOR
from kernels.model import Transformer

# the round's phases as a record's split names them: "accept+compact" is round_end_kernel's one
# launch; a record of the engine before it has "accept" and "compact" apart
ROUND_PHASES = ("draft", "top-k", "build", "verify", "accept", "compact", "accept+compact", "host")
DEVICE_PHASES = ("draft", "top-k", "build", "verify", "accept", "compact", "accept+compact")

STEM = "14_engine"
RECORD = chapter.ROOT / "docs" / "results" / "engine.json"       # python -m kernels.bench engine
NEW_TOKENS = 256                                                   # the benchmark's generation length
BLOCK, BUDGET = 4, 6                    # one small round: a tree of 7 nodes that branches
AR_AT = 0.5                             # where budget auto's AR steps (budget 0) sit on a log axis


@contextlib.contextmanager
def record_launches():
    """Every kernel launch while the block runs: (name, grid, block, shapes of its array arguments).

    The simulator's launch is ``FakeCUDAKernel.__call__`` after ``kernel[grid, block]`` set the
    dimensions; on a GPU the chapter records nothing (the table is the simulator's)."""
    launches = []
    if not SIMULATOR:
        yield launches
        return
    from numba.cuda.simulator.kernel import FakeCUDAKernel
    original = FakeCUDAKernel.__call__

    def recorded(self, *args):
        if not self._device:                      # a launch, not a device function called inside one
            shapes = [tuple(a.shape) for a in args if hasattr(a, "shape") and len(a.shape)]
            launches.append((self.fn.__qualname__.split(".")[0], self.grid_dim, self.block_dim, shapes))
        return original(self, *args)

    FakeCUDAKernel.__call__ = recorded
    try:
        yield launches
    finally:
        FakeCUDAKernel.__call__ = original


def dims(d) -> str:
    return "x".join(str(v) for v in d if v != 1) or "1"


def one_round(setup) -> None:
    """The prompt's prefill, then one round, launch by launch, grouped by phase."""
    engine = Transformer(setup.config, setup.weights, max_tree_nodes=8)
    prompt = setup.prompt
    expected = reference_decode.generate_ar(setup.model, prompt, BLOCK)
    drafter = make_drafter("noisy", setup.model, prompt, BLOCK, continuation=expected)
    cache = engine.new_cache()
    engine.prefill(cache, prompt[:-1], emit_token=False)
    with record_launches() as launches:
        record = engine_decode.ddtree_round(engine, cache, prompt, drafter, BLOCK, BUDGET, None)
    committed = [int(t) for t in record.tokens[record.accepted[1:]]] + [record.bonus]
    assert committed == expected[:record.committed].tolist(), "the round must commit AR's tokens"
    print(f"one round on micro: tree of {record.tokens.size} nodes (as many rows), accepted "
          f"{record.accepted.tolist()}, bonus {record.bonus}")
    if not launches:
        print("(run without a GPU to list the launches: the table comes from the CUDA simulator)")
        return
    with chapter.section("launches"):
        print(f"{'#':>3} {'kernel':<26} {'grid':>8} {'block':>7}  arrays (shapes)")
        for i, (name, grid, block, shapes) in enumerate(launches):
            text = ", ".join("x".join(map(str, s)) for s in shapes)
            print(f"{i:>3} {name:<26} {dims(grid):>8} {dims(block):>7}  {text[:51]}")
    print(f"{len(launches)} launches in the round ({engine.config.num_hidden_layers} layers)")


def bus_bytes() -> None:
    """What crosses the bus per round: the round's record out; in, nothing with the drafter's
    kernels in the round, its (L, V) float32 logits with a drafter on the host."""
    with chapter.section("bus"):
        print(f"{'preset':<7} {'L':>2} {'K':>3} {'B':>3} {'rows':>4} {'in (device drafter)':>20} "
              f"{'in (host drafter)':>18} {'out (record)':>13}")
        for name, block, budget in (("tiny", 8, 32), ("tiny-b", 8, 32), ("small", 8, 64)):
            config = chapter.preset(name)
            depths, k = min(block - 1, budget), min(config.vocab_size, budget)
            rows = tree_size(depths, k, budget)                                 # the tree's nodes
            sent, read = 4 * depths * config.vocab_size, 8 * (3 + 4 * rows)
            print(f"{name:<7} {depths:>2} {k:>3} {budget:>3} {rows:>4} {0:>18,} B {sent:>16,} B "
                  f"{read:>11,} B")


def measured() -> dict | None:
    """The committed engine record (its command, code, date and machine are in its header)."""
    if not RECORD.exists():
        print(f"no committed engine record {RECORD.name} under docs/results (python -m kernels.bench engine)")
        return None
    record = json.loads(RECORD.read_text(encoding="utf-8"))
    print(f"measured on the {dict(record['header'])['GPU']}: docs/results/{RECORD.name}")
    return record


def plot_tokens(record) -> None:
    """One panel per preset, a bar per system and decoder (one label line each), fastest on top."""
    results = record["results"]
    shown = [sorted((r for r in result["runs"] if r["decoder"] == "AR" or r["budget"] == 32),
                    key=lambda r: r["tokens_per_second"]) for result in results]
    heights = [max(2.0, 0.3 * len(runs) + 1.0) for runs in shown]
    fig, axes = plt.subplots(len(results), 1, figsize=(8, sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for axis, result, runs in zip(axes[:, 0], results, shown, strict=True):
        labels = [f"{r['decoder'].replace('DDTree ', '')}: {r['system']}" for r in runs]
        axis.barh(range(len(runs)), [r["tokens_per_second"] for r in runs], color="#5c6bc0")
        axis.set_yticks(range(len(runs)), labels, fontsize=9)
        axis.set_xscale("log")
        # a panel spanning under two decades would label its minor ticks too, over each other
        axis.xaxis.set_minor_formatter(NullFormatter())
        axis.set_xlabel("tokens/s (log scale)")
        axis.set_title(f"{result['preset']}: AR and DDTree (block 8, budget 32), 256 new tokens")
    fig.tight_layout()
    chapter.save_figure(fig, STEM, "tokens")


def plot_split(record) -> None:
    """One panel per preset, each on its own scale: a small model's round is tens of tiny's."""
    results = [r for r in record["results"] if "split" in r]
    splits = [r["split"] for r in results]
    phases = [p for p in ROUND_PHASES if any(p in s for split in splits for s in split.values())]
    heights = [0.3 * len(split) + 1.0 for split in splits]
    fig, axes = plt.subplots(len(results), 1, figsize=(8, sum(heights) + 0.6), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for axis, result, split in zip(axes[:, 0], results, splits, strict=True):
        left = np.zeros(len(split))
        for phase in phases:
            values = np.array([s.get(phase, 0.0) for s in split.values()])
            axis.barh(range(len(split)), values, left=left, label=phase)
            left += values
        axis.set_yticks(range(len(split)), [f"{result['preset']} {d}" for d in split], fontsize=9)
        axis.invert_yaxis()
    axes[-1, 0].set_xlabel("µs per round (budget 32; device phases between CUDA events)")
    axes[0, 0].legend(fontsize=9, ncol=(len(phases) + 1) // 2, loc="lower center", bbox_to_anchor=(0.5, 1.0))
    fig.tight_layout()
    chapter.save_figure(fig, STEM, "split")


def print_results(record) -> None:
    with chapter.section("results"):
        for result in record["results"]:
            runs = {(r["system"], r["decoder"], r["budget"]): r for r in result["runs"]}
            ar = runs[("engine, graphs", "AR", None)]
            print(f"{result['preset']}: engine AR {ar['tokens_per_second']:.0f} tok/s with graphs")
            for system in ("engine, no graphs", "numpy (CPU)", "PyTorch, CUDA graph", "transformers eager"):
                if (system, "AR", None) in runs:
                    rate = runs[(system, "AR", None)]["tokens_per_second"]
                    speedup = ar["tokens_per_second"] / rate
                    print(f"  {system} AR: {rate:.0f} tok/s (the engine with graphs: {speedup:.1f}x)")
            for (system, decoder, budget), run in runs.items():
                if system == "engine, graphs" and budget == 32:
                    host = runs.get(("engine, host drafters", decoder, budget))
                    beside = f"; drafters on the host: {host['tokens_per_second']:.0f}" if host else ""
                    print(f"  {decoder} (budget 32): {run['tokens_per_second']:.0f} tok/s, "
                          f"{run['forwards']} forwards{beside}")


def round_budget(record) -> None:
    """Each drafter's round at budget 32 in AR steps: the round's wall time (the run's new tokens
    over its tokens/s, shared among its rounds: forwards less the prefill) and the split's verify,
    against the 1.25 steps the second target allows (each round is one forward)."""
    with chapter.section("round_budget"):
        for result in record["results"]:
            runs = {(r["system"], r["decoder"], r["budget"]): r for r in result["runs"]}
            step = 1e6 / runs[("engine, graphs", "AR", None)]["tokens_per_second"]
            print(f"round at budget 32 on {result['preset']}, in AR steps of {step:.0f} us "
                  f"(the target allows 1.25)")
            print(f"  {'drafter':<8} {'rounds':>6} {'round us':>9} {'AR steps':>9} {'verify':>7} "
                  f"{'own kernels':>12}")
            for name in ("oracle", "noisy", "ngram"):
                run = runs.get(("engine, graphs", f"DDTree {name}", 32))
                split = result.get("split", {}).get(name)
                if run is None or split is None:
                    continue
                rounds = run["forwards"] - 1
                wall = 1e6 * NEW_TOKENS / run["tokens_per_second"] / rounds
                own = sum(split.get(p, 0.0) for p in DEVICE_PHASES if p != "verify")
                verify = split["verify"]
                print(f"  {name:<8} {rounds:>6} {wall:>9.0f} {wall / step:>9.2f} {verify / step:>7.2f} "
                      f"{own / step:>12.2f}")
            print()


def verify_fit(rows) -> np.ndarray:
    """Least squares over the trees of two nodes and more: verify µs = a + b x (distinct experts per
    MoE layer) + c x (rows); returns (a, b, c). The one-row forward takes its own fast path, so it
    is left out of the fit."""
    many = [row for row in rows if row["nodes"] >= 2]
    terms = np.array([[1.0, row["experts_per_layer"], row["nodes"]] for row in many])   # [n, 3]
    times = np.array([row["verify_us"] for row in many])                                # [n]
    return np.linalg.lstsq(terms, times, rcond=None)[0]


def fitted(fit: np.ndarray, row: dict) -> float:
    """The fit's verify µs for one row of the record's tree sizes."""
    return float(fit @ [1.0, row["experts_per_layer"], row["nodes"]])


def uniform_experts(nodes: np.ndarray, experts: int, chosen: int) -> np.ndarray:
    """Distinct experts per layer that ``nodes`` tokens wake if each picked its ``chosen`` of
    ``experts`` uniformly and independently: E (1 - (1 - k/E)^n)."""
    return experts * (1.0 - (1.0 - chosen / experts) ** nodes)


def moe_verify(record):
    """small's verify against its tree's size, from the record's floor section: the distinct
    experts woken per MoE layer beside uniform routing, and the verify time beside the fit.
    Returns plot_moe_verify's arguments, or None when the record has no such section."""
    result = next((r for r in record["results"] if "tree_sizes" in r), None)
    if result is None:
        return None
    config = preset(result["preset"])
    experts, chosen = config.n_routed_experts, config.num_experts_per_tok
    rows, fit = result["tree_sizes"], verify_fit(result["tree_sizes"])
    with chapter.section("moe_verify"):
        print(f"{result['preset']}: E = {experts} routed experts, k = {chosen} per token")
        print(f"  verify us ~ {fit[0]:.0f} + {fit[1]:.1f} x experts + {fit[2]:.1f} x rows "
              f"(least squares over >= 2 nodes)")
        expert = expert_bytes(config)
        print(f"  one more expert in each of its MoE layers: {expert / 1e6:.0f} MB, "
              f"{1e6 * expert / result['floor']['read_bandwidth']:.1f} us at the run's read bandwidth")
        print(f"  {'nodes':>5} {'verify us':>9} {'fit us':>7} {'experts':>7} {'uniform':>7}")
        for row in rows:
            predicted = fitted(fit, row)
            uniform = uniform_experts(np.array(row["nodes"]), experts, chosen)
            shown = f"{predicted:7.0f}" if row["nodes"] >= 2 else f"{'-':>7}"
            print(f"  {row['nodes']:>5} {row['verify_us']:>9.0f} {shown} {row['experts_per_layer']:>7.1f} "
                  f"{uniform:>7.1f}")
    return result["preset"], rows, fit, experts, chosen


def plot_moe_verify(name, rows, fit, experts, chosen) -> None:
    """Left: distinct experts per MoE layer against tree nodes, measured and uniform. Right: the
    verify's µs against tree nodes, measured and fitted."""
    nodes = np.array([row["nodes"] for row in rows])
    many = np.geomspace(1, nodes.max(), 64)
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 4))
    left.plot(nodes, [row["experts_per_layer"] for row in rows], "o-", label="measured (the record)")
    left.plot(many, uniform_experts(many, experts, chosen), "--",
              label=f"uniform: {experts} (1 - (1 - {chosen}/{experts})^n)")
    left.axhline(experts, color="gray", lw=0.8)
    left.set_xlabel("tree nodes n")
    left.set_ylabel("distinct experts per MoE layer")
    left.legend(fontsize=10)
    right.plot(nodes, [row["verify_us"] for row in rows], "o-", label="measured")
    many_rows = [row for row in rows if row["nodes"] >= 2]
    right.plot([row["nodes"] for row in many_rows], [fitted(fit, row) for row in many_rows], "--",
               label="a + b x experts + c x rows")
    right.set_xlabel("tree nodes n")
    right.set_ylabel("verify µs")
    right.legend(fontsize=10)
    for axis in (left, right):
        axis.set_xscale("log", base=2)
    fig.suptitle(f"{name}: a bigger tree wakes more experts, and each one woken is read")
    fig.tight_layout()
    chapter.save_figure(fig, STEM, "moe_verify")


def budget_curves(result) -> dict:
    """One preset's DDTree tok/s against budget, per drafter, from the engine with graphs: the
    fixed budgets' points, and budget auto's run placed at the budget its rounds chose most often
    (0: an AR step), with the AR rate to compare against."""
    runs = [r for r in result["runs"] if r["system"] == "engine, graphs"]
    curves = {"ar": next(r["tokens_per_second"] for r in runs if r["decoder"] == "AR"), "drafters": {}}
    for r in runs:
        if r["decoder"] == "AR":
            continue
        name = r["decoder"].replace("DDTree ", "")
        curve = curves["drafters"].setdefault(name, {"budgets": [], "rates": [], "auto": None})
        if r["budget"] == "auto":
            chosen = result.get("auto", {}).get(name, {}).get("budgets", [])
            most = max(set(chosen), key=lambda b: (chosen.count(b), -b)) if chosen else 0
            curve["auto"] = (most, r["tokens_per_second"])
        elif isinstance(r["budget"], int):                       # not "auto, carried"
            curve["budgets"].append(r["budget"])
            curve["rates"].append(r["tokens_per_second"])
    return curves


def plot_budgets(record) -> None:
    """One panel per preset: DDTree's tok/s against its budget for each drafter (the engine with
    graphs), AR's as a line, budget auto's run as a star at the budget it chose most often."""
    results = record["results"]
    fig, axes = plt.subplots(1, len(results), figsize=(3.3 * len(results), 3.6), squeeze=False)
    for axis, result in zip(axes[0], results, strict=True):
        curves = budget_curves(result)
        axis.axhline(curves["ar"], color="gray", ls="--", label="AR")
        for index, (name, curve) in enumerate(curves["drafters"].items()):
            color = f"C{index}"
            axis.plot(curve["budgets"], curve["rates"], "o-", color=color, label=name)
            if curve["auto"] is not None:
                budget, rate = curve["auto"]
                axis.plot(max(budget, AR_AT), rate, "*", ms=14, color=color, mec="black")
        axis.set_xscale("log", base=2)
        axis.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(
            lambda x, _: "AR" if x == AR_AT else f"{x:g}"))
        axis.set_yscale("log")
        axis.set_xlabel("budget B (star: auto)")
        axis.set_title(result["preset"])
    axes[0, 0].set_ylabel("tokens/s")
    fig.legend(*axes[0, 0].get_legend_handles_labels(), loc="lower center", ncol=4, fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    chapter.save_figure(fig, STEM, "budgets")


def main() -> None:
    setup = chapter.golden_model("micro")
    with chapter.report(STEM):
        with chapter.timed("one round on the engine"):
            one_round(setup)
        bus_bytes()
        record = measured()
        if record:
            print_results(record)
            round_budget(record)
            plot_tokens(record)
            plot_split(record)
            plot_budgets(record)
            verify = moe_verify(record)
            if verify:
                plot_moe_verify(*verify)


if __name__ == "__main__":
    main()
