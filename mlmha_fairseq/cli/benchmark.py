"""Speed and memory of this package's models as ratios to fairseq's transformer.

For every configuration, at one fixed model size and batch shape, in the same run:

* training: target tokens per second of full training steps (forward, label-smoothed
  criterion, backward, Adam);
* generation: sentences per second of fairseq's ``SequenceGenerator`` (beam 5), every
  system forced to produce the same number of tokens so that speeds compare;
* FLOPs of one training step and of one beam search (``torch.utils.flop_counter``), whose
  ratios to the baseline are the bounds the time ratios should approach;
* peak memory: the process's maximum resident set (CPU) or ``max_memory_allocated`` (CUDA)
  of one training step and one beam search, each configuration in its own process;
* the fused attention kernel (``scaled_dot_product_attention`` backend: flash, efficient,
  cudnn or math) that MLMHA's attention runs at this shape, device and type.

``--dtype fp16`` / ``bf16`` train as fairseq-train ``--fp16`` / ``--bf16`` do: the model in
the half type, fairseq's ``FP16Optimizer`` keeping fp32 master weights; beam search runs the
half-precision model, as fairseq-generate ``--fp16`` does. On CUDA every call is timed with
CUDA events after a warm-up call.

Each configuration's process also builds fairseq's transformer and alternates the two call
by call, so the time ratios compare runs made under the same machine load.

Usage: ``python -m mlmha_fairseq.cli.benchmark --output-dir bench`` (``--help`` for options),
e.g. ``--device cuda --dtype bf16 --size base --sentences 128``; writes ``benchmark.json``, ``benchmark.csv``, ``benchmark.md`` and ``benchmark.png``.
"""
import argparse
import json
import logging
import os
import subprocess
import sys
from typing import List

import torch

from mlmha_fairseq.cli import _support as cli_support
from mlmha_fairseq.experiments.systems import SIZES
from mlmha_fairseq.evaluation.benchmark import (  # noqa: F401  (importable from here, as before)
    BASELINE, COLUMNS, CONFIGURATIONS, DTYPES, SDPA_BACKENDS, Subject, build, interleaved_seconds, markdown_table,
    measure_memory, measure_speed, plot, random_sample, sdpa_backend, seconds, size_options, with_ratios,
)
from mlmha_fairseq.evaluation.text_io import write_csv, write_json, write_text

logger = logging.getLogger("mlmha_fairseq.benchmark")


def run_worker(mode: str, name: str, argv: List[str]):
    result = subprocess.run(
        [sys.executable, "-m", "mlmha_fairseq.cli.benchmark", *argv, f"--{mode}", name],
        capture_output=True, text=True,
    )
    if result.returncode != 0:
        sys.exit(f"benchmark of {name!r} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def parse_args(argv=None):
    parser = cli_support.make_parser(__spec__.name, __doc__)
    parser.add_argument("--configs", default="all",
                        help=f"comma-separated names or 'all' (always with {BASELINE}): "
                             f"{', '.join(CONFIGURATIONS)} (default: %(default)s)")
    parser.add_argument("--size", choices=SIZES, default="small",
                        help="model size, the same for every system: " + "; ".join(
                            f"{name} = {s.layers} layers, {s.embed_dim}-dim, {s.heads} heads"
                            for name, s in SIZES.items()) + " (default: %(default)s)")
    parser.add_argument("--sentences", type=int, default=32,
                        help="training batch, sentences (default: %(default)s)")
    parser.add_argument("--length", type=int, default=32,
                        help="source and target length, tokens (default: %(default)s)")
    parser.add_argument("--gen-sentences", type=int, default=16,
                        help="sentences per beam search (default: %(default)s)")
    parser.add_argument("--beam", type=int, default=5, help="beam size (default: %(default)s)")
    parser.add_argument("--vocab-size", type=int, default=8000,
                        help="joint vocabulary size of the random data (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=6,
                        help="timed training steps per system, after one warm-up (median); beam "
                             "searches: half (default: %(default)s)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="torch device to measure on, e.g. cpu, cuda, cuda:1 (default: cuda "
                             "when available, else cpu; here %(default)s)")
    parser.add_argument("--dtype", choices=DTYPES, default="fp32",
                        help="fp16 / bf16: as fairseq-train --fp16 / --bf16 (half-precision model, "
                             "fp32 master weights) and fairseq-generate --fp16 (default: %(default)s)")
    parser.add_argument("--output-dir", default="bench",
                        help="folder for benchmark.json, .csv, .md and .png (default: %(default)s)")
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
        logger.info("%d/%d %s (size %s, %s, %s)", number, len(names), name, opts.size, opts.device, opts.dtype)
        row = run_worker("speed-worker", name, argv)
        row["peak_memory_mb"] = run_worker("memory-worker", name, argv)
        rows.append(row)
    rows = with_ratios(rows)
    device = torch.device(opts.device)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    write_json(os.path.join(opts.output_dir, "benchmark.json"),
               {"settings": {**vars(opts), "device_name": device_name, "torch": torch.__version__},
                "results": rows})
    write_csv(os.path.join(opts.output_dir, "benchmark.csv"),
              [{column: row.get(column, "") for column in COLUMNS} for row in rows])
    table = markdown_table(rows)
    write_text(os.path.join(opts.output_dir, "benchmark.md"), table)
    plot(rows, os.path.join(opts.output_dir, "benchmark.png"))
    print(table)


if __name__ == "__main__":
    cli_support.command(main)
