"""The training record, docs/results/training.md: what ``train.target`` and ``train.drafter`` wrote
beside the checkpoint (``training.json``, ``drafter/drafter_training.json``), the corpus's
``corpus.json`` and ``baselines.json``, as one page. It adds nothing the runs did not measure.

    python -m train.record --checkpoint checkpoints/tiny-code --corpus .corpus --out docs/results/training.md

The page's tables carry snippet markers (``heldout``, ``drafter``) for the docs.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys


def read(path: pathlib.Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (train.target and train.drafter write it)")
    return json.loads(path.read_text(encoding="utf-8"))


def facts(run: dict) -> list[str]:
    return [f"- date (UTC): {run.get('date_utc', 'not recorded')}",
            f"- command: `{run.get('command', 'not recorded')}`",
            f"- device: {run['device']}, torch {run['torch']}"]


def heldout_table(target: dict, baselines: dict) -> list[str]:
    """Held-out bits per byte: the trained target beside the corpus's baselines."""
    rows = [("tiny-code, trained (this run)", target["heldout"]["bits_per_byte"])]
    rows += [(name, value) for name, value in baselines["bits_per_byte"].items()]
    lines = ["<!-- --8<-- [start:heldout] -->", "| model | held-out bits per byte |", "|---|---|"]
    lines += [f"| {name} | {value:.3f} |" for name, value in rows]
    return lines + ["<!-- --8<-- [end:heldout] -->"]


def target_section(target: dict, corpus: dict) -> list[str]:
    hyper = target["hyperparameters"]
    train = corpus["train"]
    epochs = target["tokens_seen"] / train["tokens"]
    loads = target["expert_load_share"]["heldout"]
    return [
        "## The target", "", *facts(target),
        f"- {target['steps']} steps of {hyper['batch']} sequences x {hyper['seq_len']} tokens: "
        f"{target['tokens_seen']:,} tokens ({epochs:.2f} passes over the {train['tokens']:,} training "
        f"tokens) in {target['wall_seconds']:.0f} s, {target['tokens_per_second']:,} tokens/s; "
        f"{hyper['precision']}",
        f"- train loss {target['first_train_loss']:.3f} -> {target['final_train_loss']:.3f} nats/token; "
        f"held-out {target['heldout']['loss_nats_per_token']:.4f} nats/token over "
        f"{target['heldout']['tokens_predicted']:,} predicted tokens "
        f"({target['heldout']['context']})",
        f"- router: V3's bias update at rate {hyper['bias_rate']} each step; on held-out text each MoE "
        f"layer's least and most used expert take "
        + ", ".join(f"{s['min']:.3f}-{s['max']:.3f}" for s in loads)
        + f" of the routed slots (balanced: {target['expert_load_share']['balanced']:.3f})",
        "",
    ]


def drafter_section(drafter: dict) -> list[str]:
    held = drafter["heldout"]
    depths = len(held["top1_agreement_with_target"])
    hyper = drafter["hyperparameters"]
    lines = [
        "## The block drafter", "", *facts(drafter),
        f"- {drafter['steps']} steps, {drafter['roots_seen']:,} roots in {drafter['wall_seconds']:.0f} s; "
        f"labels: {drafter['labels']}; window {hyper['window']}, {hyper['max_depths']} depths; "
        f"initialised from the target: {len(drafter['initialised_from_target'])} tensors",
        f"- held-out, per depth, over {held['roots']:,} roots: how often the drafter's top-1 is the "
        "target's own argmax there (the target reading the real text before it), its top-1 accuracy "
        "on the text, and its loss on the text",
        "", "<!-- --8<-- [start:drafter] -->",
        "| depth | top-1 = target's argmax | top-1 = the text | loss on the text (nats) |",
        "|---|---|---|---|",
    ]
    columns = ("top1_agreement_with_target", "top1_accuracy_on_data", "loss_nats_on_data")
    lines += ["| " + " | ".join([str(d + 1)] + [f"{held[c][d]:.3f}" for c in columns]) + " |"
              for d in range(depths)]
    return lines + ["<!-- --8<-- [end:drafter] -->", ""]


def render(checkpoint: pathlib.Path, corpus_dir: pathlib.Path) -> str:
    target = read(checkpoint / "training.json")
    drafter = read(checkpoint / "drafter" / "drafter_training.json")
    corpus = read(corpus_dir / "corpus.json")
    baselines = read(corpus_dir / "baselines.json")
    held = corpus["heldout"]
    lines = [
        "# Training record: the tiny-code target and its block drafter", "",
        f"Corpus: the Python {corpus['python']} standard library's own source; {corpus['train']['files']} "
        f"training files ({corpus['train']['bytes']:,} bytes, {corpus['train']['tokens']:,} tokens), "
        f"{held['files']} held-out files ({held['bytes']:,} bytes, {held['tokens']:,} tokens; "
        "corpus/heldout.tsv lists them with their hashes); tokenizer sha256 "
        f"{corpus['tokenizer_sha256'][:16]}... (checkpoints/tiny-code/tokenizer.json).", "",
        "Bits per byte: the held-out token losses in nats (the documents' separators included) over the "
        "held-out text's UTF-8 bytes, divided by ln 2; the baselines are `python -m train.baselines`'s.",
        "", *heldout_table(target, baselines), "",
        *target_section(target, corpus), *drafter_section(drafter),
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.record", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="the trained model's directory")
    parser.add_argument("--corpus", required=True,
                        help="the corpus's statistics (corpus.json, baselines.json)")
    parser.add_argument("--out", required=True, help="the markdown record to write")
    args = parser.parse_args(argv)
    try:
        text = render(pathlib.Path(args.checkpoint), pathlib.Path(args.corpus))
    except (FileNotFoundError, KeyError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    pathlib.Path(args.out).write_text(text, encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
