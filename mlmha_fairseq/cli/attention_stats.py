r"""Encoder self-attention mean distance and entropy per layer and head (thesis §3.5.3;
Ampomah et al. 2020, §7.3).

Example (1,500 random newstest2014 sentences, as the documents)::

    python -m mlmha_fairseq.cli.attention_stats base.pt m00.pt --names Transformer M-00 \
        --data-bin data-bin/wmt14_en_de --input test.bpe.en --sample 1500
"""
from mlmha_fairseq.cli import _support as cli_support
from mlmha_fairseq.evaluation.attention_statistics import encoder_attention_statistics
from mlmha_fairseq.evaluation.model_loading import checkpoint_batches, read_sentences
from mlmha_fairseq.evaluation.plotting import plot_attention_heatmaps, plot_attention_layers
from mlmha_fairseq.evaluation.text_io import write_csv, write_json

def build_parser():
    parser = cli_support.checkpoint_analysis_parser(
        __spec__.name, __doc__, "fairseq checkpoints (any model of this package or fairseq's transformer)",
        "attention_stats", sample_note="; the documents: 1500")
    parser.add_argument("--full-row", action="store_true",
                        help="sum over all keys j with |i-j| instead of the literal j<=i, i-j")
    parser.add_argument("--exclude-eos", action="store_true",
                        help="drop EOS rows and columns (default: keep EOS, drop padding)")
    return parser


def attention_stats(parser, args) -> None:
    names = cli_support.system_names(parser, args.checkpoints, args.names)
    lines = read_sentences(args)
    rows, models, layer_means = [], [], {}
    for name, model, task, tokens, progress in checkpoint_batches(names, args, lines):
        dictionary = task.source_dictionary
        stats = encoder_attention_statistics(model, progress, dictionary.pad(), dictionary.eos(),
                                             args.full_row, args.exclude_eos)
        rows.extend(dict(row, model=name) for row in stats.rows())
        models.append((name, stats.head_distance(), stats.head_entropy()))
        layer_means[name] = {"distance": stats.layer_distance().tolist(),
                             "entropy": stats.layer_entropy().tolist()}
        print(f"{name}: per-layer mean distance "
              + " ".join(f"{d:.3f}" for d in layer_means[name]["distance"])
              + " | entropy " + " ".join(f"{e:.4f}" for e in layer_means[name]["entropy"]))
    write_csv(args.output_prefix + ".csv", rows)
    write_json(args.output_prefix + ".json", {"sentences": len(tokens), "full_row": args.full_row,
                                              "exclude_eos": args.exclude_eos, "layers": layer_means})
    plot_attention_heatmaps(models, args.output_prefix + "_heads.png")
    plot_attention_layers(models, args.output_prefix + "_layers.png")


def main(argv=None) -> None:
    cli_support.run(build_parser(), attention_stats, argv)


if __name__ == "__main__":
    cli_support.command(main)
