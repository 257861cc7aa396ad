"""Performance: every kernel against its floor, the engine's forward kernel by kernel, and the
engine against tree size and context length. Everything here is read from the committed GPU
records under docs/results/, one per kind, each naming the GPU it ran on (nothing is measured on
this machine):

* bench.md: each kernel at Kimi K2.6 shapes (``python -m kernels.bench``): its device time
  (outputs given, from a CUDA graph) and its public call's, against its floor
  max(bytes / read bandwidth, FLOPs / fp32 rate), and torch's device time for the same work; the
  kernel issue's targets that it measures;
* profile.md: the engine's forward on tiny, tiny-b and small, each kernel's device time at one row
  (the AR step) and at 40 (a budget-32 tree) (``python -m kernels.bench profile``);
* engine.json: ``small``'s AR step against its floor, and the verify time against the tree's size
  (``python -m kernels.bench engine``, its result for ``small``);
* sweep.json: ``small`` against context length (``python -m kernels.bench sweep``).

Run: .venv/bin/python walkthrough/15_performance.py

Writes docs/assets/figures/15_performance_*.png and 15_performance_report.txt (what it prints).
"""

from __future__ import annotations

import json
import re

import chapter  # walkthrough/chapter.py: figures, the report file, the Agg backend
import matplotlib.pyplot as plt
import numpy as np

STEM = "15_performance"
RESULTS = chapter.ROOT / "docs" / "results"
BENCH = RESULTS / "bench.md"
PROFILE = RESULTS / "profile.md"
ENGINE = RESULTS / "engine.json"
SWEEP = RESULTS / "sweep.json"
PROFILE_PRESETS = ("tiny", "tiny-b", "small")
PROFILE_ROWS = ("T=1", "T=40")          # the AR step and a budget-32 tree's rows
TOTALS = ("sum of kernels", "graph replay")


def number(cell: str) -> float:
    return float("nan") if cell in ("-", "") else float(cell)


# --8<-- [start:kernel_floors]
def kernel_floors() -> tuple[list[dict], dict[str, float]]:
    """Each benchmark case as the record states it: the kernels' device time (outputs given,
    replayed from a CUDA graph), the public call's time, the share of its floor reached (the run's
    own read bandwidth and fp32 rate) and torch's device time for the same work, where measured;
    and the run's ceilings (read bytes/s and fp32 FLOP/s as kernels.bench.hardware reads them, one
    empty kernel's device seconds)."""
    text = BENCH.read_text(encoding="utf-8")
    hw = chapter.gpu()                                    # the same record: hardware.RESULTS
    ceilings = {
        "read": hw.bandwidth, "fp32": hw.fp32,
        "empty": float(re.search(r"([\d.]+) µs of device time per launch replayed", text).group(1)) * 1e-6}
    cases = [case_row(row, ceilings["empty"]) for row in chapter.read_table(text, "case")]
    return cases, ceilings


def case_row(row: dict[str, str], empty: float) -> dict:
    """One case of the record as the chapter uses it (seconds and fractions)."""
    return {"case": row["case"], "device": number(row["device µs"]) * 1e-6,
            "call": number(row["call µs"]) * 1e-6, "of_floor": number(row["% of floor"]) / 100,
            "torch": number(row["torch µs"]) * 1e-6, "read": number(row["% of read BW"]) / 100,
            "bound": "FLOPs" if row["% of read BW"] == "-" else "bytes", "empty": empty,
            "note": row["note"]}
# --8<-- [end:kernel_floors]


def floors_report(cases, ceilings) -> None:
    with chapter.section("floors"):
        read, fp32 = ceilings["read"], ceilings["fp32"]
        print(f"{BENCH.name}, measured on the {chapter.gpu().name}:")
        print(f"  read {read / 1e9:.0f} GB/s, fp32 {fp32 / 1e12:.0f} TFLOP/s, "
              f"ridge {fp32 / read:.1f} FLOP/B, empty kernel {ceilings['empty'] * 1e6:.2f} us in a graph")
        print(f"{'case':<28} {'device':>10} {'call':>10} {'of floor':>9} {'torch':>10} "
              f"{'vs torch':>8}  bound")
        for c in cases:
            torch = f"{c['torch'] * 1e6:>8.0f}us {c['torch'] / c['device']:>7.2f}x" \
                if c["torch"] == c["torch"] else f"{'-':>10} {'-':>8}"
            print(f"{c['case']:<28} {c['device'] * 1e6:>8.1f}us {c['call'] * 1e6:>8.0f}us "
                  f"{100 * c['of_floor']:>8.2f}% {torch}  {c['bound']}")


def plot_floors(cases) -> None:
    """A pair of bars per case, one label line each: the figure grows with the cases, not the font."""
    fig, axis = plt.subplots(figsize=(8, max(6.0, 0.25 * len(cases) + 1.8)))
    y = np.arange(len(cases))
    axis.barh(y - 0.2, [100 * c["of_floor"] for c in cases], 0.4, color="tab:blue",
              label="the kernels (device time, from a graph)")
    axis.barh(y + 0.2, [100 * c["of_floor"] * c["device"] / c["call"] for c in cases], 0.4,
              color="tab:gray", label="one public call from Python")
    axis.set_yticks(y, [c["case"] for c in cases], fontsize=9)
    axis.set_ylim(len(cases) - 0.4, -0.6)                                   # first case on top
    axis.set_xscale("log")
    axis.set_xlabel("share of the floor reached (%), log scale:\n100% = max(bytes/BW, FLOPs/fp32)")
    axis.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=1, fontsize=9)
    axis.set_title(f"Each kernel at Kimi K2.6 shapes\n({chapter.gpu().name}, docs/results/{BENCH.name})",
                   pad=48)
    fig.tight_layout()
    chapter.save_figure(fig, STEM, "floors")


# --8<-- [start:targets]
# (target, the cases that measure it, the engine's first: the first the record has is read)
ATTENTION = ("paths_v5_", "paths_v4_")          # the engine's attention where R >= 512, newest first
TARGETS = (
    (">= 64 MB at >= 80% of read BW", ("rmsnorm_large",)),
    (">= 64 MB at >= 80% of read BW", ("rope_q_pe_large",)),
    (">= 64 MB at >= 80% of read BW", ("linear_lanes_mlp_up", "linear_gemv_mlp_up")),
    (">= 64 MB at >= 80% of read BW", ("linear_lanes_lm_head", "linear_gemv_lm_head")),
    ("device time <= 2x an empty kernel's", ("rmsnorm",)),
    ("device time <= 2x an empty kernel's", ("kv_compact",)),
    ("GEMM >= 0.5x torch", ("linear_lanes_prefill", "linear_tiles_gemm_prefill")),
    ("GEMM >= 0.5x torch", ("linear_lanes_verify", "linear_tiles_gemm_verify")),
    ("tree build, 64 requests >= 100x the heap", ("tree_build_medium",)),
    ("tree build, one request < 20 us", ("tree_build_one",)),
    ("MoE router >= 50% of floor", ("moe_route",)),
    ("MoE experts >= 60% of read BW", ("moe_reduced_v3", "moe_reduced")),
)


def measure(target: str, case: dict) -> tuple[float, float, bool]:
    """(measured, needed, met) of one target on one case. Ratios: % of floor, % of read bandwidth,
    torch's time over ours, the heap's speed-up (from the case's note), device time over one empty
    kernel's in a graph, µs."""
    if target.startswith(">= 64 MB"):
        return 100 * case["read"], 80.0, 100 * case["read"] >= 80
    if target.startswith("device time"):
        ratio = case["device"] / case["empty"]
        return ratio, 2.0, ratio <= 2
    if target.startswith("GEMM"):
        return case["torch"] / case["device"], 0.5, case["torch"] / case["device"] >= 0.5
    if target.startswith("tree build, 64"):
        heap = float(re.search(r"= ([\d.]+)x the GPU time", case["note"]).group(1))
        return heap, 100.0, heap >= 100
    if target.startswith("tree build, one"):
        return case["device"] * 1e6, 20.0, case["device"] * 1e6 < 20
    needed = 50.0 if "router" in target else 60.0
    share = 100 * (case["of_floor"] if "router" in target else case["read"])
    return share, needed, share >= needed


def kernel_targets(cases) -> tuple[list[tuple[str, str, float, float, bool]], list[str]]:
    """The kernel issue's targets that the bench record measures, as (target, case, measured,
    needed, met), and the targets it has no case for."""
    by_name = {c["case"]: c for c in cases}
    rows, missing = [], []
    prefix = next((p for p in ATTENTION if any(name.startswith(p) for name in by_name)), None)
    for case in (c for c in cases if prefix and c["case"].startswith(prefix)):
        rows.append(("attention >= 40% of floor", case["case"], 100 * case["of_floor"], 40.0,
                     case["of_floor"] >= 0.4))
        speed, needed = case["torch"] / case["device"], 0.6 if case["bound"] == "FLOPs" else 1.5
        rows.append((f"attention >= {needed}x torch ({case['bound']}-bound)", case["case"], speed, needed,
                     speed >= needed))
    for target, names in TARGETS:
        name = next((n for n in names if n in by_name), None)
        if name is None:
            missing.append(f"{target} ({' or '.join(names)})")
        else:
            rows.append((target, name, *measure(target, by_name[name])))
    return rows, missing
# --8<-- [end:targets]


def targets_report(rows, missing) -> None:
    with chapter.section("targets"):
        print(f"{'target':<40} {'case':<29} {'measured':>9} {'needed':>7}  verdict")
        for target, name, measured, needed, met in rows:
            print(f"{target:<40} {name:<29} {measured:>9.3g} {needed:>7.3g}  {'met' if met else 'missed'}")
        for target in missing:
            print(f"not in {BENCH.name}: {target}")


def empty_kernel_report(cases) -> None:
    """For the "2x an empty kernel" targets: the measured ratio beside what the bytes alone take at
    the run's read bandwidth (device time x its share of it), both in empty kernels."""
    by_name = {c["case"]: c for c in cases}
    with chapter.section("empty_kernels"):
        print(f"{'case':<12} {'device':>9} {'empty':>8} {'bytes at read':>14} {'device / empty':>15} "
              f"{'bytes / empty':>14}")
        for name in ("rmsnorm", "kv_compact"):
            if name not in by_name:
                continue
            c = by_name[name]
            at_read = c["device"] * c["read"]                   # bytes / the run's read bandwidth
            print(f"{name:<12} {c['device'] * 1e6:>7.2f}us {c['empty'] * 1e6:>6.2f}us "
                  f"{at_read * 1e6:>12.2f}us {c['device'] / c['empty']:>15.2f} {at_read / c['empty']:>14.2f}")


# --8<-- [start:profile]
def profile() -> dict[str, dict[str, dict[str, float]]]:
    """Device µs per kernel in one forward (events around each launch, summed over the layers) and
    the forward's graph replay, by preset, kernel and T column, from the profile record's section
    of each preset ("## <preset>: device µs per kernel ...")."""
    text = PROFILE.read_text(encoding="utf-8")
    tables = {}
    for preset in PROFILE_PRESETS:
        heading = rf"^## {re.escape(preset)}: device µs per kernel"
        section = re.search(rf"{heading}.*?(?=^## |\Z)", text, re.M | re.S)
        rows = chapter.read_table(section.group(0), "kernel")
        tables[preset] = {r["kernel"].strip("*"): {t: number(r[t]) for t in PROFILE_ROWS} for r in rows}
    return tables
# --8<-- [end:profile]


def profile_report(tables, shown: int = 6) -> None:
    with chapter.section("profile"):
        for preset, table in tables.items():
            replay = table["graph replay"]
            print(f"{preset}: device us per forward after 136 cached tokens; T=1 is the AR step, T=40 a "
                  f"budget-32 tree")
            print(f"  {'kernel':<30} {'T=1':>8} {'T=40':>8} {'growth':>8}")
            kernels = sorted((n for n in table if n not in TOTALS), key=lambda n: -max(table[n].values()))
            for name in [*kernels[:shown], *TOTALS]:
                one, many = table[name]["T=1"], table[name]["T=40"]
                print(f"  {name.split('.')[-1]:<30} {one:>8.1f} {many:>8.1f} {many - one:>+8.1f}")
            events = table["sum of kernels"]["T=1"] / replay["T=1"]
            print(f"  the 40-row forward costs {replay['T=40'] / replay['T=1']:.2f} AR steps in graph "
                  f"replay; the events sum to {events:.2f}x the replay at T=1")
            print()


def plot_profile(tables, shown: int = 8) -> None:
    """One panel per preset, stacked: each kernel's name on one line at a readable size."""
    fig, axes = plt.subplots(len(tables), 1, figsize=(8, 2.9 * len(tables)))
    for axis, (preset, table) in zip(axes, tables.items(), strict=True):
        kernels = sorted((n for n in table if n not in TOTALS), key=lambda n: -max(table[n].values()))[:shown]
        y = np.arange(len(kernels))
        for offset, column in zip((-0.2, 0.2), PROFILE_ROWS, strict=True):
            axis.barh(y + offset, [table[k][column] for k in kernels], 0.4, label=column)
        labels = [k.split(".")[-1].replace("_kernel", "").replace("attention_", "att. ") for k in kernels]
        axis.set_yticks(y, labels, fontsize=9)
        axis.invert_yaxis()
        axis.set_title(f"{preset}: the {shown} kernels with the most device time", fontsize=10)
        axis.set_xlabel("device µs per forward", fontsize=9)
    axes[0].legend(title="rows")
    fig.tight_layout()
    chapter.save_figure(fig, STEM, "profile")


def small_report(record) -> dict:
    """small's AR step against its floor and the verify against tree size, from the engine
    record's result for small (the GPU its header names)."""
    result = next((r for r in record["results"] if r["preset"] == "small" and "floor" in r), None)
    if result is None:
        raise ValueError(f"{ENGINE.name} has no floor for small (python -m kernels.bench engine "
                         "--presets small)")
    floor, sizes = result["floor"], result["tree_sizes"]
    with chapter.section("small"):
        weights, bandwidth = floor["weight_bytes_per_token"] / 1e9, floor["read_bandwidth"] / 1e9
        print(f"{ENGINE.name}, measured on the {dict(record['header'])['GPU']}:")
        print(f"small: AR step {floor['ar_step_us'] / 1e3:.2f} ms, floor {floor['floor_us'] / 1e3:.2f} ms "
              f"({weights:.2f} GB at {bandwidth:.0f} GB/s read): "
              f"{floor['ar_step_us'] / floor['floor_us']:.1f}x")
        print(f"{'tree nodes':>10} {'verify ms':>10} {'per node':>9} {'in AR steps':>12} "
              f"{'experts/layer':>14}")
        for row in sizes:
            verify = row["verify_us"] / 1e3
            print(f"{row['nodes']:>10} {verify:>10.2f} {verify / row['nodes']:>9.2f} "
                  f"{row['verify_us'] / floor['ar_step_us']:>12.2f} {row['experts_per_layer']:>14.1f}")
    return result


def sweep_report(record) -> list[dict]:
    """The sweep's rows by context, with DDTree over AR for each drafter."""
    rows = record["result"]["rows"]
    with chapter.section("sweep"):
        print(f"{'context':>8} {'AR tok/s':>9} {'oracle':>8} {'/ AR':>6} {'noisy':>8} {'/ AR':>6} "
              f"{'att. share':>10}")
        for r in rows:
            ar = r["ar_tokens_per_second"]
            oracle, noisy = (r[f"ddtree_{d}"]["tokens_per_second"] for d in ("oracle", "noisy"))
            print(f"{r['context']:>8} {ar:>9.1f} {oracle:>8.1f} {oracle / ar:>6.2f} {noisy:>8.1f} "
                  f"{noisy / ar:>6.2f} {100 * r['attention_share']:>9.0f}%")
    return rows


def plot_small(result, rows) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.4))
    sizes = result["tree_sizes"]
    left.plot([s["nodes"] for s in sizes], [s["verify_us"] / 1e3 for s in sizes], "o-", label="verify")
    left.axhline(result["floor"]["ar_step_us"] / 1e3, color="gray", ls="--", label="AR step")
    left.set_xscale("log", base=2)
    left.set_xlabel("tree nodes")
    left.set_ylabel("ms")
    left.set_title("small: verify time against tree size")
    left.legend()
    contexts = [r["context"] for r in rows]
    right.plot(contexts, [r["ar_tokens_per_second"] for r in rows], "o-", label="AR")
    for drafter, marker in (("oracle", "s"), ("noisy", "^")):
        right.plot(contexts, [r[f"ddtree_{drafter}"]["tokens_per_second"] for r in rows], marker=marker,
                   label=f"DDTree {drafter} (budget 32)")
    right.set_xscale("log", base=2)
    right.set_xlabel("context (tokens)")
    right.set_ylabel("tokens/s")
    right.set_title("small: tokens/s against context")
    right.legend()
    fig.tight_layout()
    chapter.save_figure(fig, STEM, "small")


def main() -> None:
    cases, ceilings = kernel_floors()
    floors_report(cases, ceilings)
    plot_floors(cases)
    targets_report(*kernel_targets(cases))
    empty_kernel_report(cases)
    tables = profile()
    profile_report(tables)
    plot_profile(tables)
    result = small_report(json.loads(ENGINE.read_text(encoding="utf-8")))
    rows = sweep_report(json.loads(SWEEP.read_text(encoding="utf-8")))
    plot_small(result, rows)


if __name__ == "__main__":
    with chapter.report(STEM):
        main()
