r"""Jensen-Shannon divergence between the Dual Contextual module's two FI units (thesis Fig. 5.4).

Examples (the kernel-size sweep of thesis §5.6.2, Figs. 5.3-5.4, on newstest2014)::

    python -m mlmha_fairseq.cli.dc_diversity f2.pt f3.pt f5.pt --names f=2 f=3 f=5 \
        --data-bin data-bin/wmt14_en_de --split test --output-prefix results/dc_diversity
    python -m mlmha_fairseq.cli.dc_diversity f2.pt --input newstest2014.bpe.en --sample 1000
"""
from mlmha_fairseq.cli import _support as cli_support
from mlmha_fairseq.evaluation.fi_diversity import HEAD_REDUCTIONS, MAX, fi_diversity, plot_fi_diversity
from mlmha_fairseq.evaluation.model_loading import checkpoint_batches, read_sentences
from mlmha_fairseq.evaluation.text_io import write_csv, write_json

def build_parser():
    parser = cli_support.checkpoint_analysis_parser(
        __spec__.name, __doc__, "fairseq checkpoints of models with --dc-encoder-layers", "dc_diversity")
    parser.add_argument("--head-reduction", choices=HEAD_REDUCTIONS, default=MAX,
                        help="how one distribution represents the heads: element-wise max, "
                             "renormalised (default), or the head with the highest peak")
    return parser


def dc_diversity(parser, args) -> None:
    names = cli_support.system_names(parser, args.checkpoints, args.names)
    lines = read_sentences(args)
    rows, results, models = [], {}, {}
    for name, model, task, tokens, progress in checkpoint_batches(names, args, lines):
        accumulator = fi_diversity(model, progress, task.source_dictionary.pad(), args.head_reduction)
        models[name] = accumulator
        rows.extend(dict(model=name, **row) for row in accumulator.table())
        results[name] = {"layers": accumulator.table(), "E_d": accumulator.mean_divergence(),
                         "sentences": len(tokens)}
        print(f"{name}: JS per DC layer "
              + " ".join(f"{row['layer']}:{row['js_divergence']:.4f}" for row in accumulator.table())
              + f" | E_d {accumulator.mean_divergence():.4f}")
    write_csv(args.output_prefix + ".csv", rows)
    write_json(args.output_prefix + ".json", {"head_reduction": args.head_reduction,
                                              "log": "natural", "models": results})
    plot_fi_diversity(models, args.output_prefix + ".png")


def main(argv=None) -> None:
    cli_support.run(build_parser(), dc_diversity, argv)


if __name__ == "__main__":
    cli_support.command(main)
