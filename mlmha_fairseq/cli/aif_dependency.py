r"""KL divergence between the AIF Main-Decoder and its ind-decoder (thesis §4.5.5, Fig. 4.7).

Examples (the thesis' setting: 1,000 random En-Vi test sentences, MS-l + AIF models)::

    python -m mlmha_fairseq.cli.aif_dependency ms1_aif.pt ms2_aif.pt ms3_aif.pt \
        --names MS-1+AIF MS-2+AIF MS-3+AIF --data-bin data-bin/iwslt15_en_vi --split test \
        --sample 1000 --output-prefix results/aif_dependency
    python -m mlmha_fairseq.cli.aif_dependency ms3_aif.pt --input sentence.bpe.en --per-token
"""
from mlmha_fairseq.cli import _support as cli_support
from mlmha_fairseq.evaluation.aif_dependency import aif_dependency, plot_aif_dependency
from mlmha_fairseq.evaluation.model_loading import checkpoint_batches, read_sentences
from mlmha_fairseq.evaluation.text_io import write_csv, write_json

DEFAULT_MAX_LEN_A, DEFAULT_MAX_LEN_B = 1.0, 20  # the authors' code: source length + 20


def build_parser():
    parser = cli_support.checkpoint_analysis_parser(
        __spec__.name, __doc__, "fairseq checkpoints of ms_transformer models with --aux-fusion", "aif_dependency",
        sample_note="; the thesis: 1000")
    parser.add_argument("--max-len-a", type=float, default=DEFAULT_MAX_LEN_A,
                        help="greedy decoding length limit a * source length + b "
                             "(default: a = %(default)s)")
    parser.add_argument("--max-len-b", type=int, default=DEFAULT_MAX_LEN_B,
                        help="(default: b = %(default)s)")
    parser.add_argument("--per-token", action="store_true",
                        help="also write every sentence's tokens and per-token KL (Fig. 4.8)")
    return parser


def token_details(accumulator, tgt_dict):
    """Per sentence: the greedy output's tokens (EOS included) and the KL of each (Fig. 4.8)."""
    return [{"tokens": [tgt_dict[index] for index in hypothesis], "output_kl": values}
            for hypothesis, values in zip(accumulator.hypotheses, accumulator.token_divergences)]


def aif_dependency_cli(parser, args) -> None:
    names = cli_support.system_names(parser, args.checkpoints, args.names)
    lines = read_sentences(args)
    rows, results, models = [], {}, {}
    for name, model, task, _tokens, progress in checkpoint_batches(names, args, lines):
        accumulator = aif_dependency(model, progress, task.target_dictionary,
                                     args.max_len_a, args.max_len_b)
        models[name] = accumulator
        rows.extend(dict(model=name, **row) for row in accumulator.table())
        results[name] = {
            "output_kl": accumulator.output_divergence(),
            "attention_kl_per_layer": accumulator.layer_divergence().tolist(),
            "attention_kl_per_head": accumulator.head_divergence().tolist(),
            "sentences": len(accumulator.sentence_divergences),
        }
        if args.per_token:
            results[name]["per_token"] = token_details(accumulator, task.target_dictionary)
        print(f"{name}: KL(P_m || P_ind) {accumulator.output_divergence():.4f} | attention KL per "
              "decoder layer " + " ".join(f"{layer}:{value:.4f}" for layer, value
                                          in enumerate(accumulator.layer_divergence(), 1)))
    write_csv(args.output_prefix + ".csv", rows)
    write_json(args.output_prefix + ".json", {"log": "natural", "models": results})
    plot_aif_dependency(models, args.output_prefix + ".png")


def main(argv=None) -> None:
    cli_support.run(build_parser(), aif_dependency_cli, argv)


if __name__ == "__main__":
    cli_support.command(main)
