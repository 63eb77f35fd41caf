"""Speed and memory of this package's models as ratios to fairseq's transformer.

For every configuration, at one fixed model size and batch shape, in the same run:

* training: target tokens per second of full training steps (forward, backward, Adam);
* generation: sentences per second of fairseq's ``SequenceGenerator`` (beam 5), every
  system forced to produce the same number of tokens so that speeds compare;
* peak memory: the process's maximum resident set (CPU) or ``max_memory_allocated`` (CUDA),
  each configuration measured in its own process;
* FLOPs of one training step (``torch.utils.flop_counter``), whose ratio to the baseline is
  the bound the speed ratio should approach.

Usage: ``python -m mlmha_fairseq.cli.benchmark --output-dir bench`` (``--help`` for options);
writes ``benchmark.json``, ``benchmark.csv``, ``benchmark.md`` and ``benchmark.png``.
"""
import argparse
import csv
import json
import logging
import os
import resource
import subprocess
import sys
import time
from statistics import median
from typing import Dict, List, Tuple

import torch

logger = logging.getLogger("mlmha_fairseq.benchmark")
BASELINE = "transformer"

# name -> (architecture, options); the fixed size is set by --size on top of these.
CONFIGURATIONS: Dict[str, Tuple[str, List[str]]] = {
    BASELINE: ("transformer", []),
    "slot_transformer": ("slot_transformer", []),
    **{
        f"mlmha {variant}": ("slot_transformer", ["--decoder-cross-attention", "multi-layer", "--mlmha-variant", variant])
        for variant in ("M-00", "M-01", "M-10", "M-11")
    },
    **{
        f"aggregation {name}": ("slot_transformer", ["--layer-aggregation", name])
        for name in ("s-agg", "iter-s-agg", "c-agg", "iter-c-agg", "transparent")
    },
    **{
        f"mlrf {name}": ("slot_transformer", ["--mlrf-encoder-fusion", encoder, "--mlrf-decoder-fusion", decoder, *extra])
        for name, encoder, decoder, extra in (
            ("Enc-FNN", "fnn", "none", []),
            ("Dec-SA", "none", "sa", []),
            ("Dec-SA + indep. W1", "none", "sa", ["--mlrf-indep-w1"]),
            ("Both-FNN-SA", "fnn", "sa", []),
        )
    },
    "mma": ("slot_transformer", ["--encoder-self-attention", "mixed"]),  # H/4 heads each of G, L, F, B
    # Dual Contextual (thesis ch. 5, f = 2): Enc-DC, Dec-DC, Full-DC
    "dc encoder": ("slot_transformer", ["--dc-encoder-layers", "all"]),
    "dc decoder": ("slot_transformer", ["--dc-decoder-layers", "all"]),
    "dc full": ("slot_transformer", ["--dc-encoder-layers", "all", "--dc-decoder-layers", "all"]),
}

SIZES = {
    "small": dict(embed_dim=256, ffn_embed_dim=1024, heads=4, layers=4),
    "base": dict(embed_dim=512, ffn_embed_dim=2048, heads=8, layers=6),
}


def size_options(size: str) -> List[str]:
    s = SIZES[size]
    options = []
    for side in ("encoder", "decoder"):
        options += [f"--{side}-embed-dim", s["embed_dim"], f"--{side}-ffn-embed-dim", s["ffn_embed_dim"],
                    f"--{side}-attention-heads", s["heads"], f"--{side}-layers", s["layers"]]
    return [str(o) for o in options] + ["--share-all-embeddings", "--dropout", "0.1"]


def build(name: str, size: str, vocab_size: int):
    from fairseq import options, tasks
    from fairseq.data import Dictionary

    import mlmha_fairseq

    arch, extra = CONFIGURATIONS[name]
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(
        parser,
        ["unused", "--task", "translation", "--user-dir", os.path.dirname(mlmha_fairseq.__file__),
         "--arch", arch, *size_options(size), *extra],
    )
    dictionary = Dictionary()
    for i in range(vocab_size - dictionary.nspecial):
        dictionary.add_symbol(f"w{i}")
    task = tasks.translation.TranslationTask(args, dictionary, dictionary)
    return task.build_model(args), dictionary


def random_batch(dictionary, sentences: int, length: int, device):
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(dictionary.nspecial, len(dictionary), (sentences, length), generator=gen)
    tokens[:, -1] = dictionary.eos()
    prev = torch.roll(tokens, 1, dims=1)
    lengths = torch.full((sentences,), length)
    return tokens.to(device), lengths.to(device), prev.to(device)


def timed(fn, steps: int, warmup: int, device) -> float:
    """Median seconds per call after warm-up."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return median(times)


def measure(name: str, opts) -> dict:
    """All numbers of one configuration (run inside its own process)."""
    from fairseq.sequence_generator import SequenceGenerator
    from torch.utils.flop_counter import FlopCounterMode

    device = torch.device(opts.device)
    torch.manual_seed(0)
    model, dictionary = build(name, opts.size, opts.vocab_size)
    model.to(device)
    src, lengths, prev = random_batch(dictionary, opts.sentences, opts.length, device)
    optimizer = torch.optim.Adam(model.parameters())

    def train_step():
        optimizer.zero_grad()
        logits = model(src, lengths, prev)[0]
        torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), src.view(-1)).backward()
        optimizer.step()

    model.train()
    with FlopCounterMode(display=False) as counter:
        train_step()
    train_seconds = timed(train_step, opts.steps, opts.warmup, device)

    model.eval()
    generator = SequenceGenerator([model], dictionary, beam_size=opts.beam, max_len_a=0,
                                  max_len_b=opts.length, min_len=opts.length)
    sample = {"net_input": {"src_tokens": src[: opts.gen_sentences], "src_lengths": lengths[: opts.gen_sentences]}}

    def generate():
        with torch.no_grad():
            generator.generate([model], sample)

    gen_seconds = timed(generate, max(1, opts.steps // 2), 1, device)
    if device.type == "cuda":
        peak_mb = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # KiB on Linux
    return {
        "name": name,
        "params": sum(p.numel() for p in model.parameters()),
        "train_tokens_per_s": opts.sentences * opts.length / train_seconds,
        "gen_sentences_per_s": opts.gen_sentences / gen_seconds,
        "peak_memory_mb": peak_mb,
        "train_step_flops": counter.get_total_flops(),
    }


def run_in_subprocess(name: str, argv: List[str]) -> dict:
    result = subprocess.run(
        [sys.executable, "-m", "mlmha_fairseq.cli.benchmark", *argv, "--worker", name],
        capture_output=True, text=True,
    )
    if result.returncode != 0:
        sys.exit(f"benchmark of {name!r} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def with_ratios(rows: List[dict]) -> List[dict]:
    base = next(row for row in rows if row["name"] == BASELINE)
    for row in rows:
        row["flop_ratio"] = row["train_step_flops"] / base["train_step_flops"]
        row["train_time_ratio"] = base["train_tokens_per_s"] / row["train_tokens_per_s"]
        row["gen_time_ratio"] = base["gen_sentences_per_s"] / row["gen_sentences_per_s"]
        row["memory_ratio"] = row["peak_memory_mb"] / base["peak_memory_mb"]
        row["param_ratio"] = row["params"] / base["params"]
    return rows


COLUMNS = ["name", "params", "param_ratio", "flop_ratio", "train_time_ratio", "gen_time_ratio",
           "memory_ratio", "train_tokens_per_s", "gen_sentences_per_s", "peak_memory_mb"]


def markdown_table(rows: List[dict]) -> str:
    header = ("| configuration | params | FLOPs x | train time x | generation time x | peak memory x "
              "| train tok/s | gen sent/s |\n|---|---|---|---|---|---|---|---|\n")
    return header + "".join(
        f"| {r['name']} | {r['params'] / 1e6:.2f}M | {r['flop_ratio']:.2f} | {r['train_time_ratio']:.2f} "
        f"| {r['gen_time_ratio']:.2f} | {r['memory_ratio']:.2f} | {r['train_tokens_per_s']:.0f} "
        f"| {r['gen_sentences_per_s']:.2f} |\n"
        for r in rows
    )


def plot(rows: List[dict], path: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["name"] for r in rows]
    width = 0.27
    fig, ax = plt.subplots(figsize=(10, 4))
    for offset, (key, label) in enumerate(
        [("flop_ratio", "FLOPs"), ("train_time_ratio", "training time"), ("gen_time_ratio", "generation time")]
    ):
        ax.bar([i + (offset - 1) * width for i in range(len(rows))], [r[key] for r in rows], width, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)), names, rotation=30, ha="right")
    ax.set_ylabel(f"ratio to fairseq's {BASELINE}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default="all",
                        help=f"comma-separated names or 'all' (always with {BASELINE}): {', '.join(CONFIGURATIONS)}")
    parser.add_argument("--size", choices=SIZES, default="small")
    parser.add_argument("--sentences", type=int, default=32, help="training batch, sentences")
    parser.add_argument("--length", type=int, default=32, help="source and target length, tokens")
    parser.add_argument("--gen-sentences", type=int, default=16)
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--steps", type=int, default=6, help="timed training steps (median)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--output-dir", default="bench")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    opts = parse_args(argv)
    if opts.worker:
        print(json.dumps(measure(opts.worker, opts)))
        return
    logging.basicConfig(format="[benchmark] %(message)s", level=logging.INFO, force=True)
    names = list(CONFIGURATIONS) if opts.configs == "all" else [BASELINE] + [
        n for n in opts.configs.split(",") if n != BASELINE
    ]
    unknown = [n for n in names if n not in CONFIGURATIONS]
    if unknown:
        sys.exit(f"error: unknown configuration(s) {unknown}; choose from {list(CONFIGURATIONS)}")
    rows = []
    for number, name in enumerate(names, 1):
        logger.info("%d/%d %s (size %s, %s)", number, len(names), name, opts.size, opts.device)
        rows.append(run_in_subprocess(name, argv))
    rows = with_ratios(rows)
    os.makedirs(opts.output_dir, exist_ok=True)
    with open(os.path.join(opts.output_dir, "benchmark.json"), "w") as f:
        json.dump({"settings": vars(opts), "results": rows}, f, indent=2)
    with open(os.path.join(opts.output_dir, "benchmark.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    table = markdown_table(rows)
    with open(os.path.join(opts.output_dir, "benchmark.md"), "w") as f:
        f.write(table)
    plot(rows, os.path.join(opts.output_dir, "benchmark.png"))
    print(table)


if __name__ == "__main__":
    main()
