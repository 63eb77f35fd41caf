"""Speed and memory of this package's models as ratios to fairseq's transformer.

For every configuration, at one fixed model size and batch shape, in the same run:

* training: target tokens per second of full training steps (forward, label-smoothed
  criterion, backward, Adam);
* generation: sentences per second of fairseq's ``SequenceGenerator`` (beam 5), every
  system forced to produce the same number of tokens so that speeds compare;
* FLOPs of one training step and of one beam search (``torch.utils.flop_counter``), whose
  ratios to the baseline are the bounds the time ratios should approach;
* peak memory: the process's maximum resident set (CPU) or ``max_memory_allocated`` (CUDA)
  of one training step and one beam search, each configuration in its own process.

Each configuration's process also builds fairseq's transformer and alternates the two call
by call, so the time ratios compare runs made under the same machine load.

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
    # multi-level supervision (thesis ch. 4, Table 4.6a), trained with the joint loss: without
    # AIF generation runs the main decoder only; with AIF the auxiliary decoders run in lock-step.
    **{
        name: ("ms_transformer", ["--aux-decoder-layers", layers, *fusion,
                                  "--criterion", "multi_decoder_label_smoothed_cross_entropy"])
        for name, layers, fusion in (
            ("MS-1", "1", []),
            ("MS-1 + AIF", "1", ["--aux-fusion"]),
            ("MS-123 + AIF", "1,2,3", ["--aux-fusion"]),
        )
    },
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
    """The model, its training criterion and dictionary, built as fairseq-train builds them."""
    from fairseq import options, tasks
    from fairseq.data import Dictionary

    import mlmha_fairseq

    arch, extra = CONFIGURATIONS[name]
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(
        parser,
        ["unused", "--task", "translation", "--user-dir", os.path.dirname(mlmha_fairseq.__file__),
         "--arch", arch, "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
         *size_options(size), *extra],
    )
    dictionary = Dictionary()
    for i in range(vocab_size - dictionary.nspecial):
        dictionary.add_symbol(f"w{i}")
    task = tasks.translation.TranslationTask(args, dictionary, dictionary)
    return task.build_model(args), task.build_criterion(args), dictionary


def random_sample(dictionary, sentences: int, length: int, device):
    """A training batch of random tokens, every sentence ``length`` tokens long."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(dictionary.nspecial, len(dictionary), (sentences, length), generator=gen)
    tokens[:, -1] = dictionary.eos()
    net_input = {
        "src_tokens": tokens.to(device),
        "src_lengths": torch.full((sentences,), length, device=device),
        "prev_output_tokens": torch.roll(tokens, 1, dims=1).to(device),
    }
    return {"net_input": net_input, "target": tokens.to(device), "ntokens": sentences * length,
            "nsentences": sentences}


class Subject:
    """One configuration ready to time: a training step (forward, criterion, backward,
    Adam) and beam search forced to ``length`` tokens, so that every system decodes as much."""

    def __init__(self, name: str, opts, device):
        from fairseq.sequence_generator import SequenceGenerator

        torch.manual_seed(0)
        self.name = name
        self.model, self.criterion, dictionary = build(name, opts.size, opts.vocab_size)
        self.model.to(device)
        self.sample = random_sample(dictionary, opts.sentences, opts.length, device)
        self.optimizer = torch.optim.Adam(self.model.parameters())
        self.beam = opts.beam
        self.generator = SequenceGenerator([self.model], dictionary, beam_size=opts.beam,
                                           max_len_a=0, max_len_b=opts.length, min_len=opts.length)
        net_input = self.sample["net_input"]
        self.gen_sample = {"net_input": {key: net_input[key][: opts.gen_sentences]
                                         for key in ("src_tokens", "src_lengths")}}

    def train_step(self):
        self.model.train()
        self.optimizer.zero_grad()
        loss, _, _ = self.criterion(self.model, self.sample)
        loss.backward()
        self.optimizer.step()

    def generate(self):
        """Beam search as fairseq-generate runs it: after ``prepare_for_inference_`` (no
        attention weights but the alignment layer's, beamable cross-attention), which
        forbids training afterwards, so every training measurement comes first."""
        if not self.model._is_generation_fast:
            self.model.make_generation_fast_(beamable_mm_beam_size=self.beam, need_attn=False)
        self.model.eval()
        with torch.no_grad():
            self.generator.generate([self.model], self.gen_sample)

    def flops(self, action: str) -> int:
        """FLOPs of one call of ``action`` (``train_step`` or ``generate``)."""
        from torch.utils.flop_counter import FlopCounterMode

        with FlopCounterMode(display=False) as counter:
            getattr(self, action)()
        return counter.get_total_flops()


def interleaved_seconds(subjects: List[Subject], action: str, repeats: int, device) -> List[float]:
    """Median seconds of ``action`` per subject, the subjects alternating call by call so
    that a change of machine load affects them alike (after one warm-up call each).
    Not ``torch.utils.benchmark.Timer``: it times one statement's runs back to back."""
    times = [[] for _ in subjects]
    for repeat in range(repeats + 1):
        for subject, collected in zip(subjects, times):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            getattr(subject, action)()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if repeat > 0:
                collected.append(time.perf_counter() - start)
    return [median(t) for t in times]


def measure_speed(name: str, opts) -> dict:
    """Speed and FLOPs of ``name`` and of the baseline, measured together in this process."""
    device = torch.device(opts.device)
    subjects = [Subject(BASELINE, opts, device)] + ([Subject(name, opts, device)] if name != BASELINE else [])
    train = interleaved_seconds(subjects, "train_step", opts.steps, device)
    train_flops = [subject.flops("train_step") for subject in subjects]
    generate = interleaved_seconds(subjects, "generate", max(1, opts.steps // 2), device)
    gen_flops = [subject.flops("generate") for subject in subjects]
    return {
        "name": name,
        "params": sum(p.numel() for p in subjects[-1].model.parameters()),
        "train_tokens_per_s": opts.sentences * opts.length / train[-1],
        "gen_sentences_per_s": opts.gen_sentences / generate[-1],
        "train_time_ratio": train[-1] / train[0],
        "gen_time_ratio": generate[-1] / generate[0],
        "flop_ratio": train_flops[-1] / train_flops[0],
        "gen_flop_ratio": gen_flops[-1] / gen_flops[0],
    }


def measure_memory(name: str, opts) -> float:
    """Peak memory (MiB) of one training step and one beam search of ``name`` alone: CUDA's
    peak allocation, or on CPU the process's peak resident set (interpreter included)."""
    device = torch.device(opts.device)
    subject = Subject(name, opts, device)
    subject.train_step()
    subject.generate()
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # KiB on Linux


def run_worker(mode: str, name: str, argv: List[str]):
    result = subprocess.run(
        [sys.executable, "-m", "mlmha_fairseq.cli.benchmark", *argv, f"--{mode}", name],
        capture_output=True, text=True,
    )
    if result.returncode != 0:
        sys.exit(f"benchmark of {name!r} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def with_ratios(rows: List[dict]) -> List[dict]:
    base = next(row for row in rows if row["name"] == BASELINE)
    for row in rows:
        row["memory_ratio"] = row["peak_memory_mb"] / base["peak_memory_mb"]
        row["param_ratio"] = row["params"] / base["params"]
    return rows


COLUMNS = ["name", "params", "param_ratio", "flop_ratio", "train_time_ratio", "gen_flop_ratio", "gen_time_ratio",
           "memory_ratio", "train_tokens_per_s", "gen_sentences_per_s", "peak_memory_mb"]


def markdown_table(rows: List[dict]) -> str:
    header = ("| configuration | params | train FLOPs x | train time x | generation FLOPs x "
              "| generation time x | peak memory x | train tok/s | gen sent/s |\n"
              "|---|---|---|---|---|---|---|---|---|\n")
    return header + "".join(
        f"| {r['name']} | {r['params'] / 1e6:.2f}M | {r['flop_ratio']:.2f} | {r['train_time_ratio']:.2f} "
        f"| {r['gen_flop_ratio']:.2f} | {r['gen_time_ratio']:.2f} | {r['memory_ratio']:.2f} "
        f"| {r['train_tokens_per_s']:.0f} "
        f"| {r['gen_sentences_per_s']:.2f} |\n"
        for r in rows
    )


def plot(rows: List[dict], path: str):
    """Bars of the FLOP and time ratios per configuration, 1 = fairseq's transformer."""
    from mlmha_fairseq.evaluation.plotting import pyplot, save_figure

    bars = [("flop_ratio", "training FLOPs"), ("train_time_ratio", "training time"),
            ("gen_flop_ratio", "generation FLOPs"), ("gen_time_ratio", "generation time")]
    width = 0.8 / len(bars)
    figure, axis = pyplot().subplots(figsize=(12, 4))
    for offset, (key, label) in enumerate(bars):
        positions = [i + (offset - (len(bars) - 1) / 2) * width for i in range(len(rows))]
        axis.bar(positions, [row[key] for row in rows], width, label=label)
    axis.axhline(1.0, color="black", linewidth=0.8)
    axis.set_xticks(range(len(rows)), [row["name"] for row in rows], rotation=35, ha="right")
    axis.set_ylabel(f"ratio to fairseq's {BASELINE}")
    axis.legend()
    save_figure(figure, path)


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
    parser.add_argument("--steps", type=int, default=6,
                        help="timed training steps per system, after one warm-up (median); beam searches: half")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--output-dir", default="bench")
    parser.add_argument("--speed-worker", help=argparse.SUPPRESS)
    parser.add_argument("--memory-worker", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    opts = parse_args(argv)
    if opts.speed_worker:
        print(json.dumps(measure_speed(opts.speed_worker, opts)))
        return
    if opts.memory_worker:
        print(json.dumps(measure_memory(opts.memory_worker, opts)))
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
        row = run_worker("speed-worker", name, argv)
        row["peak_memory_mb"] = run_worker("memory-worker", name, argv)
        rows.append(row)
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
