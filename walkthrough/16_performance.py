"""Performance: every kernel against its floor, the engine's forward kernel by kernel, and the
engine against tree size and context length. Everything here is read from the committed H200
records under docs/results/ (nothing is measured on this machine):

* bench-h200-2026-12-01d.md: each kernel at Kimi K2.6 shapes (``python -m kernels.bench``): its
  device time (outputs given, from a CUDA graph) and its public call's, against its floor
  max(bytes / copy bandwidth, FLOPs / fp32 rate), and torch's device time for the same work; the
  kernel issue's targets that it measures; bench-h200-2026-12-01g.md: attention's version 5
  (unfused), the engine's from R = 512, at the same shapes, which the attention targets read;
  bench-h200-2026-12-02.md: the MoE cases again, with the expert kernels' version 3;
  bench-h200-2026-12-02b.md: version 5's cases again, its statistics a warp per chunk;
  bench-h200-2026-12-04.md: RMSNorm's two batches, RoPE's two versions and the GEMVs ("gemv" and
  the engine's "lanes", which the GEMV targets read) again (a later record's case replaces the
  earlier one of the same name);
* profile-h200-2026-11-30.md: the engine's forward on tiny, each kernel's device time, before and
  after the "tiles" kernels (``python -m kernels.bench profile``);
* engine-small-h200-2026-12-03e.json: ``small``'s AR step against its floor, and the verify time
  against the tree's size (``python -m kernels.bench engine --floor-only``), with MoE version 3,
  linear's "lanes", attention version 5's statistics a warp per chunk, the decode-row launch
  shapes (version 5's scores and tail, one-row passes) and the fusions (residual adds inside the
  RMSNorms, q_a and kv_a in one projection, one RoPE launch, x loaded with W) and a decode row's
  own scores kernel (row_scores_kernel), and its router in one launch (route_one_kernel), its
  absorbed query in passes of one row and the batched argmax;
* sweep-small-h200-2026-11-30.json: ``small`` against context length (``python -m kernels.bench
  sweep``), with attention's version 1; sweep-small-h200-2026-12-01.json: the same at two contexts
  with attention's version 2 (split over the keys); sweep-small-h200-2026-12-01b.json: at four
  contexts with version 4 (register-tiled); sweep-small-h200-2026-12-01c.json: the same with
  version 5 (unfused), the engine's default for small; sweep-small-h200-2026-12-02.json: the same
  with version 5 and the MoE kernels' version 3; sweep-small-h200-2026-12-02b.json: the same with
  linear's "lanes" too, all three the engine's defaults for small now; sweep-small-h200-2026-12-02c
  .json: the same with the decode-row launch shapes; sweep-small-h200-2026-12-02d.json: and the
  fusions; sweep-small-h200-2026-12-02e.json: and a decode row's own scores kernel;
  sweep-small-h200-2026-12-03.json: and its router, argmax and absorbed-query launches.

Run: python walkthrough/16_performance.py

Writes docs/assets/figures/16_performance_*.png and 16_performance_report.txt (what it prints).
"""

from __future__ import annotations

import json
import re

import chapter  # walkthrough/chapter.py: figures, the report file, the Agg backend
import matplotlib.pyplot as plt
import numpy as np

STEM = "16_performance"
RESULTS = chapter.ROOT / "docs" / "results"
BENCH = RESULTS / "bench-h200-2026-12-01d.md"
BENCH_UNFUSED = RESULTS / "bench-h200-2026-12-01g.md"       # attention version 5, a later run
BENCH_MOE = RESULTS / "bench-h200-2026-12-02.md"            # the MoE cases with version 3, later still
BENCH_STATS = RESULTS / "bench-h200-2026-12-02b.md"         # version 5 again: its statistics' warps
BENCH_BANDWIDTH = RESULTS / "bench-h200-2026-12-04.md"      # RMSNorm's batch, RoPE version 2, the GEMVs
# that run's "rmsnorm*" cases took batch 16 at every row count, its "*_batch8" cases 8: the case that
# runs what the default (kernels.rmsnorm.row_batch) takes now, for each name the targets read
TODAYS_DEFAULT = {BENCH_BANDWIDTH: {"rmsnorm_large": "rmsnorm_large_batch8"}}
PROFILE = RESULTS / "profile-h200-2026-11-30.md"
SMALL = RESULTS / "engine-small-h200-2026-12-03e.json"
SWEEP = RESULTS / "sweep-small-h200-2026-11-30.json"
SWEEP_SPLIT = RESULTS / "sweep-small-h200-2026-12-01.json"   # attention split over the keys
SWEEP_GEMM = RESULTS / "sweep-small-h200-2026-12-01b.json"   # attention version 4 (register-tiled)
SWEEP_UNFUSED = RESULTS / "sweep-small-h200-2026-12-01c.json"   # attention version 5 (unfused)
SWEEP_MOE = RESULTS / "sweep-small-h200-2026-12-02.json"       # ... and the MoE kernels' version 3
SWEEP_LANES = RESULTS / "sweep-small-h200-2026-12-02b.json"     # ... and linear's "lanes"
SWEEP_SHAPES = RESULTS / "sweep-small-h200-2026-12-02c.json"    # ... and the decode-row launch shapes
SWEEP_FUSED = RESULTS / "sweep-small-h200-2026-12-02d.json"     # ... and the fusions
SWEEP_ROW = RESULTS / "sweep-small-h200-2026-12-02e.json"       # ... and a decode row's own scores
SWEEP_DECODE = RESULTS / "sweep-small-h200-2026-12-03.json"    # ... and its router, argmax, absorbed query
ATTENTION_CASES = ("paths_v5_decode", "paths_v5_decode_long", "paths_v5_decode_rank_long",
                   "paths_v5_tree_few", "paths_v5_tree_many", "paths_v5_tree_many_rank_long")
PROFILE_ROWS = ("T=1", "T=40")          # the AR step and a budget-32 tree's bucket


def number(cell: str) -> float:
    return float("nan") if cell in ("-", "") else float(cell)


# --8<-- [start:kernel_floors]
def kernel_floors() -> list[dict]:
    """Each benchmark case as its record states it: the kernels' device time (outputs given,
    replayed from a CUDA graph), the public call's time, the share of its floor reached (the run's
    own copy bandwidth and fp32 rate) and torch's device time for the same work, where measured.
    Every ratio comes from one run; attention's version 5, the MoE cases and the bandwidth-bound
    ones come from later runs than the others, and a later record's case replaces an earlier one of
    the same name. ``empty``: one empty kernel's device time in the case's own run."""
    cases = {}
    for record in (BENCH, BENCH_UNFUSED, BENCH_MOE, BENCH_STATS, BENCH_BANDWIDTH):
        text = record.read_text(encoding="utf-8")
        empty = float(re.search(r"([\d.]+) µs of device time per launch replayed", text).group(1)) * 1e-6
        rows = {row["case"]: row for row in chapter.read_table(text, "case")}
        for name, measured in TODAYS_DEFAULT.get(record, {}).items():
            rows[name] = dict(rows[measured], case=name)
        for name, row in rows.items():
            cases[name] = case_row(row, empty)
    return list(cases.values())


def case_row(row: dict[str, str], empty: float) -> dict:
    """One case of a record as the chapter uses it (seconds and fractions)."""
    return {"case": row["case"], "device": number(row["device µs"]) * 1e-6,
            "call": number(row["call µs"]) * 1e-6, "of_floor": number(row["% of floor"]) / 100,
            "torch": number(row["torch µs"]) * 1e-6, "copy": number(row["% of copy BW"]) / 100,
            "bound": "FLOPs" if row["% of copy BW"] == "-" else "bytes", "empty": empty}
# --8<-- [end:kernel_floors]


def floors_report(cases) -> None:
    with chapter.section("floors"):
        print(f"{'case':<28} {'device':>10} {'call':>10} {'of floor':>9} {'torch':>10} "
              f"{'vs torch':>8}  bound")
        for c in cases:
            torch = f"{c['torch'] * 1e6:>8.0f}us {c['torch'] / c['device']:>7.2f}x" \
                if c["torch"] == c["torch"] else f"{'-':>10} {'-':>8}"
            print(f"{c['case']:<28} {c['device'] * 1e6:>8.1f}us {c['call'] * 1e6:>8.0f}us "
                  f"{100 * c['of_floor']:>8.2f}% {torch}  {c['bound']}")


def plot_floors(cases) -> None:
    fig, axis = plt.subplots(figsize=(9.5, 9))
    y = np.arange(len(cases))
    axis.barh(y - 0.2, [100 * c["of_floor"] for c in cases], 0.4, color="tab:blue",
              label="the kernels (device time, from a graph)")
    axis.barh(y + 0.2, [100 * c["of_floor"] * c["device"] / c["call"] for c in cases], 0.4,
              color="tab:gray", label="one public call from Python")
    axis.set_yticks(y, [c["case"] for c in cases])
    axis.set_xscale("log")
    axis.set_xlabel("share of the floor reached (%), log scale: 100% = max(bytes/BW, FLOPs/fp32)")
    axis.invert_yaxis()
    axis.legend(loc="upper center", bbox_to_anchor=(0.5, -0.07), ncol=2)
    axis.set_title("Each kernel at Kimi K2.6 shapes (H200, each case's newest record)")
    fig.tight_layout()
    chapter.save_figure(fig, STEM, "floors")


# --8<-- [start:targets]
def kernel_targets(cases) -> list[tuple[str, str, float, float, bool]]:
    """The kernel issue's targets that the bench record measures: (target, case, measured,
    needed, met). Ratios: % of floor, % of copy bandwidth, torch's time over ours, the heap's
    speed-up, device time over one empty kernel's in a graph."""
    by_name = {c["case"]: c for c in cases}
    text = BENCH.read_text(encoding="utf-8")
    heap = {m.group(1): float(m.group(2)) for m in re.finditer(
        r"\| (tree_build_\w+) \|[^\n]*= ([\d.]+)x the GPU time", text)}
    rows = []
    for name in ATTENTION_CASES:                # the engine's version (5) where R >= 512
        case = by_name[name]
        rows.append(("attention >= 40% of floor", name, 100 * case["of_floor"], 40.0))
        if case["bound"] == "FLOPs":
            rows.append(("attention >= 0.6x torch (FLOPs-bound)", name, case["torch"] / case["device"], 0.6))
        else:
            rows.append(("attention >= 1.5x torch (bytes-bound)", name, case["torch"] / case["device"], 1.5))
    # the GEMVs: "lanes", the engine's (version 1, "gemv", beside it in the floors above)
    for name in ("rmsnorm_large", "rope_q_pe_large", "linear_lanes_mlp_up", "linear_lanes_lm_head"):
        rows.append((">= 64 MB at >= 80% of copy BW", name, 100 * by_name[name]["copy"], 80.0))
    for name in ("rmsnorm", "kv_compact"):
        rows.append(("device time <= 2x an empty kernel's", name,
                     by_name[name]["device"] / by_name[name]["empty"], 2.0))
    for name in ("linear_tiles_gemm_prefill", "linear_tiles_gemm_verify"):
        rows.append(("GEMM >= 0.5x torch", name, by_name[name]["torch"] / by_name[name]["device"], 0.5))
    rows.append(("tree build, 64 requests >= 100x the heap", "tree_build_medium",
                 heap["tree_build_medium"], 100))
    rows.append(("tree build, one request < 20 us", "tree_build_one",
                 by_name["tree_build_one"]["device"] * 1e6, 20.0))
    rows.append(("MoE router >= 50% of floor", "moe_route", 100 * by_name["moe_route"]["of_floor"], 50.0))
    experts = "moe_reduced_v3" if "moe_reduced_v3" in by_name else "moe_reduced"   # the engine's version 3
    rows.append(("MoE experts >= 60% of copy BW", experts, 100 * by_name[experts]["copy"], 60.0))
    at_most = ("device time <= 2x an empty kernel's", "tree build, one request < 20 us")
    return [(target, name, measured, needed, measured <= needed if target in at_most else measured >= needed)
            for target, name, measured, needed in rows]
# --8<-- [end:targets]


def targets_report(rows) -> None:
    with chapter.section("targets"):
        print(f"{'target':<40} {'case':<29} {'measured':>9} {'needed':>7}  verdict")
        for target, name, measured, needed, met in rows:
            print(f"{target:<40} {name:<29} {measured:>9.3g} {needed:>7.3g}  {'met' if met else 'missed'}")


def empty_kernel_report(cases) -> None:
    """For the "2x an empty kernel" targets: the measured ratio beside what the bytes alone take at
    the run's copy bandwidth (device time x its share of the copy), both in empty kernels."""
    by_name = {c["case"]: c for c in cases}
    with chapter.section("empty_kernels"):
        print(f"{'case':<12} {'device':>9} {'empty':>8} {'bytes at copy':>14} {'device / empty':>15} "
              f"{'bytes / empty':>14}")
        for name in ("rmsnorm", "kv_compact"):
            c = by_name[name]
            at_copy = c["device"] * c["copy"]                   # bytes / the run's copy bandwidth
            print(f"{name:<12} {c['device'] * 1e6:>7.2f}us {c['empty'] * 1e6:>6.2f}us "
                  f"{at_copy * 1e6:>12.2f}us {c['device'] / c['empty']:>15.2f} {at_copy / c['empty']:>14.2f}")


# --8<-- [start:profile]
def profile(part: str) -> dict[str, dict[str, float]]:
    """Device µs per kernel in the forward (``part``: "before" or "after"), by T column."""
    rows = chapter.read_table(chapter.snippet(PROFILE.read_text(encoding="utf-8"), f"{part}-tiny"), "kernel")
    return {r["kernel"].strip("*"): {t: number(r[t]) for t in PROFILE_ROWS} for r in rows}
# --8<-- [end:profile]


def profile_report(before, after) -> None:
    with chapter.section("profile"):
        print("tiny, device us per forward; T=1 is the AR step, T=40 a budget-32 tree")
        print(f"{'kernel':<24} {'before T=1':>11} {'T=40':>8} {'after T=1':>10} {'T=40':>8}")
        totals = ("sum of kernels", "graph replay")
        def largest(name):
            return -max(table.get(name, {"T=40": 0})["T=40"] for table in (before, after))

        names = sorted((set(before) | set(after)) - set(totals), key=largest)
        for name in [*names, *totals]:
            b, a = before.get(name), after.get(name)
            cells = [f"{row[t]:>8.0f}" if row else f"{'-':>8}" for row in (b, a) for t in PROFILE_ROWS]
            print(f"{name:<24} {cells[0]:>11} {cells[1]:>8} {cells[2]:>10} {cells[3]:>8}")
        for part, table in (("before", before), ("after", after)):
            replay = table["graph replay"]
            print(f"{part}: one graph replay {replay['T=1']:.0f} us at T=1, {replay['T=40']:.0f} us at T=40: "
                  f"the tree costs {replay['T=40'] / replay['T=1']:.2f} AR steps")


def plot_profile(before, after) -> None:
    kernels = [n for n in sorted(before, key=lambda n: -before[n]["T=40"])
               if n not in ("sum of kernels", "graph replay")][:8]
    renamed = {"rows_kernel": "tiles_kernel"}                   # the linear layers, before and after
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.5), sharey=True)
    for axis, column in zip(axes, PROFILE_ROWS, strict=True):
        y = np.arange(len(kernels))
        axis.barh(y - 0.2, [before[k][column] for k in kernels], 0.4, label="before")
        axis.barh(y + 0.2, [after.get(renamed.get(k, k), {column: 0})[column] for k in kernels], 0.4,
                  label="after")
        axis.set_yticks(y, ["linear (rows, then tiles)" if k == "rows_kernel" else k.replace("_kernel", "")
                            for k in kernels])
        axis.set_title(f"{column} ({'AR step' if column == 'T=1' else 'a 40-row verify'})")
        axis.set_xlabel("device µs per forward (all layers)")
    axes[0].invert_yaxis()
    axes[0].legend()
    fig.tight_layout()
    chapter.save_figure(fig, STEM, "profile")


def small_report(record) -> dict:
    result = record["results"][0]
    floor, sizes = result["floor"], result["tree_sizes"]
    with chapter.section("small"):
        weights, bandwidth = floor["weight_bytes_per_token"] / 1e9, floor["copy_bandwidth"] / 1e9
        print(f"small: AR step {floor['ar_step_us'] / 1e3:.2f} ms, floor {floor['floor_us'] / 1e3:.2f} ms "
              f"({weights:.2f} GB at {bandwidth:.0f} GB/s): {floor['ar_step_us'] / floor['floor_us']:.1f}x")
        print(f"{'tree nodes':>10} {'verify ms':>10} {'per node':>9} {'experts/layer':>14}")
        for row in sizes:
            verify = row["verify_us"] / 1e3
            print(f"{row['nodes']:>10} {verify:>10.2f} {verify / row['nodes']:>9.2f} "
                  f"{row['experts_per_layer']:>14.1f}")
    return result


def sweep_report(records: dict[str, dict]) -> dict[str, list[dict]]:
    """Each sweep's rows by attention version (the records' ``result.rows``)."""
    sweeps = {version: record["result"]["rows"] for version, record in records.items()}
    with chapter.section("sweep"):
        print(f"{'attention':<44} {'context':>8} {'AR tok/s':>9} {'oracle':>8} {'noisy':>8} "
              f"{'att. share':>10}")
        for version, rows in sweeps.items():
            for r in rows:
                oracle = r["ddtree_oracle"]["tokens_per_second"]
                noisy = r["ddtree_noisy"]["tokens_per_second"]
                print(f"{version:<44} {r['context']:>8} {r['ar_tokens_per_second']:>9.1f} {oracle:>8.1f} "
                      f"{noisy:>8.1f} {100 * r['attention_share']:>9.0f}%")
    return sweeps


def plot_small(result, sweeps) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 7.2))
    sizes = result["tree_sizes"]
    left.plot([s["nodes"] for s in sizes], [s["verify_us"] / 1e3 for s in sizes], "o-", label="verify")
    left.axhline(result["floor"]["ar_step_us"] / 1e3, color="gray", ls="--", label="AR step")
    left.set_xscale("log", base=2)
    left.set_xlabel("tree nodes")
    left.set_ylabel("ms")
    left.set_title("small: verify time against tree size")
    left.legend()
    lines = ((":", 1.5), ("-.", 1.5), ("--", 1.5), ("-", 0.8), ("-", 1.6), ("-", 2.6),   # (style, width)
             ("-", 3.6), ("-", 5.0), ("-", 6.4), ("-", 7.8))
    for (version, rows), (style, width) in zip(sweeps.items(), lines, strict=True):
        contexts = [r["context"] for r in rows]
        right.plot(contexts, [r["ar_tokens_per_second"] for r in rows], marker="o", ls=style, lw=width,
                   color="tab:blue", label=f"AR, attention {version}")
        right.plot(contexts, [r["ddtree_oracle"]["tokens_per_second"] for r in rows], marker="s", ls=style,
                   lw=width, color="tab:orange", label=f"DDTree oracle, attention {version}")
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.set_xlabel("context (tokens)")
    right.set_ylabel("tokens/s")
    right.set_title("small: tokens/s against context")
    fig.legend(*right.get_legend_handles_labels(), loc="lower center", ncol=2, fontsize="x-small")  # below
    fig.tight_layout(rect=(0, 0.29, 1, 1))
    chapter.save_figure(fig, STEM, "small")


def main() -> None:
    cases = kernel_floors()
    floors_report(cases)
    plot_floors(cases)
    targets_report(kernel_targets(cases))
    empty_kernel_report(cases)
    before, after = profile("before"), profile("after")
    profile_report(before, after)
    plot_profile(before, after)
    result = small_report(json.loads(SMALL.read_text(encoding="utf-8")))
    sweeps = sweep_report({version: json.loads(path.read_text(encoding="utf-8"))
                           for version, path in (("v1", SWEEP), ("v2", SWEEP_SPLIT), ("v4", SWEEP_GEMM),
                                                 ("v5", SWEEP_UNFUSED), ("v5, MoE v3", SWEEP_MOE),
                                                 ("v5, MoE v3, lanes", SWEEP_LANES),
                                                 ("v5, MoE v3, lanes, shapes", SWEEP_SHAPES),
                                                 ("v5, MoE v3, lanes, shapes, fused", SWEEP_FUSED),
                                                 ("v5, MoE v3, lanes, shapes, fused, row scores",
                                                  SWEEP_ROW),
                                                 ("v5, ..., row scores, decode kernels", SWEEP_DECODE))})
    plot_small(result, sweeps)


if __name__ == "__main__":
    with chapter.report(STEM):
        main()
