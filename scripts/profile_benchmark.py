"""Where a benchmark configuration spends its time: torch.profiler's operator table of one
training step or one beam search of ``mlmha_fairseq.cli.benchmark``'s subjects, after a
warm-up call (docs/benchmark/generation_profile.md).

    python scripts/profile_benchmark.py generate transformer "mlmha M-00" --threads 1 \
        -- --gen-sentences 8 --length 24

Arguments after ``--`` are the benchmark's own (shape, device, dtype).
"""
import argparse
import sys

import torch
from torch.profiler import profile

from mlmha_fairseq.cli import benchmark


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    own, benchmark_args = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("generate", "train_step"))
    parser.add_argument("configs", nargs="+", help="benchmark configuration names")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default: 1)")
    parser.add_argument("--rows", type=int, default=10, help="operators listed (default: 10)")
    args = parser.parse_args(own)
    torch.set_num_threads(args.threads)
    opts = benchmark.parse_args(benchmark_args)
    for name in args.configs:
        subject = benchmark.Subject(name, opts, torch.device(opts.device))
        getattr(subject, args.action)()
        with profile() as profiler:
            getattr(subject, args.action)()
        print(f"== {name}: {args.action}")
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
