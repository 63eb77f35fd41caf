r"""Per-head encoder self-attention weights of chosen sentences, as data and PNG heat maps.

For the MMA paper's Figure 3 (Cui et al. 2019): every encoder layer and head, rows are query
tokens and columns key tokens, padding removed, EOS kept. Example::

    python -m mlmha_fairseq.cli.dump_attention checkpoints/mma/checkpoint_best.pt \
        --data-bin data-bin/iwslt14.tokenized.de-en --input test.de --lines 1 42 \
        --bpe-codes iwslt14.tokenized.de-en/code --output-dir figure3

writes ``attention.json`` (tokens and head types per layer), one ``line<k>.npz`` per sentence
(``weights``: layers x heads x n x n float32, ``tokens``) and one ``line<k>.png``.
"""
import os

import numpy as np

from mlmha_fairseq.cli import _support as cli_support
from mlmha_fairseq.evaluation.attention_dump import head_types, plot_sentence_attention, sentence_attention
from mlmha_fairseq.evaluation.model_loading import apply_bpe, encode_lines, left_pad_source, load_model
from mlmha_fairseq.evaluation.text_io import InputError, read_lines, write_arrays, write_json


def build_parser():
    parser = cli_support.make_parser(__spec__.name, __doc__)
    parser.add_argument("checkpoint", help="a fairseq checkpoint (any model of this package or "
                                           "fairseq's transformer)")
    parser.add_argument("--data-bin", help="data directory with the dictionaries "
                                           "(default: the one stored in the checkpoint)")
    parser.add_argument("--input", required=True,
                        help="source sentences, tokenized (and BPE-segmented unless --bpe-codes)")
    parser.add_argument("--lines", type=int, nargs="+", metavar="K",
                        help="1-based line numbers of --input to dump (default: every line)")
    parser.add_argument("--bpe-codes", help="subword-nmt codes to apply to --input")
    parser.add_argument("--output-dir", default="attention_dump",
                        help="directory for attention.json, line<k>.npz and line<k>.png "
                             "(default: %(default)s)")
    parser.add_argument("--no-plots", action="store_true", help="write the data only")
    return parser


def chosen_lines(lines, numbers):
    """``(number, line)`` for the 1-based ``numbers`` (every line if None)."""
    numbers = numbers or range(1, len(lines) + 1)
    bad = [k for k in numbers if not 1 <= k <= len(lines)]
    if bad:
        raise InputError(f"--lines {bad}: the input has lines 1..{len(lines)}")
    return [(k, lines[k - 1]) for k in numbers]


def dump_attention(parser, args) -> None:
    chosen = chosen_lines(read_lines(args.input), args.lines)
    model, task = load_model(args.checkpoint, args.data_bin)
    dictionary = task.source_dictionary
    token_lists = encode_lines(apply_bpe([line for _, line in chosen], args.bpe_codes), dictionary)
    weights = sentence_attention(model, token_lists, dictionary, left_pad_source(task))
    types = head_types(model)
    os.makedirs(args.output_dir, exist_ok=True)
    sentences = []
    for (number, _), tokens, sentence_weights in zip(chosen, token_lists, weights):
        words = [dictionary[index] for index in tokens.tolist()]
        stem = os.path.join(args.output_dir, f"line{number}")
        write_arrays(stem + ".npz", weights=sentence_weights, tokens=np.array(words))
        if not args.no_plots:
            plot_sentence_attention(words, sentence_weights, types, stem + ".png", f"line {number}")
        sentences.append({"line": number, "tokens": words, "data": os.path.basename(stem) + ".npz"})
    write_json(os.path.join(args.output_dir, "attention.json"),
               {"checkpoint": args.checkpoint, "head_types": types, "sentences": sentences})
    print(f"wrote {len(sentences)} sentence(s) to {args.output_dir}")


def main(argv=None) -> None:
    cli_support.run(build_parser(), dump_attention, argv)


if __name__ == "__main__":
    cli_support.command(main)
