r"""MLRF SA hop weights per position during forced decoding, as data and PNG heat maps.

For the MLRF paper's Figure 5 (§4.8): the weights ``a_p^l`` of every hop p
over the fused layers l0..lL at each target position of a Dec-SA model (``--side encoder``:
each source position of an Enc-SA model), the reference fed in as in training. Example::

    python -m mlmha_fairseq.cli.mlrf_hop_weights checkpoints/dec_sa/checkpoint_best.pt \
        --data-bin data-bin/iwslt14.tokenized.de-en --split test --lines 1 42

or with text (tokenized, BPE-segmented unless --bpe-codes)::

    python -m mlmha_fairseq.cli.mlrf_hop_weights ckpt.pt --source test.de --target test.en --lines 3

writes ``PREFIX.json`` (tokens, layers, weights hops x layers x positions per sentence, the
mean over all positions), ``PREFIX.csv`` (one row per sentence, position, hop and layer) and
``PREFIX_line<k>.png`` for the first ``--plots`` sentences.

Several checkpoints of one training run (e.g. every update checkpoint, kept with
``--keep-interval-updates -1``) give the weights over training instead: ``PREFIX.json`` and
``PREFIX.csv`` hold each checkpoint's update count and mean weights (hop x layer, over every
position of the chosen sentences) and ``PREFIX.png`` draws them against the updates::

    python -m mlmha_fairseq.cli.mlrf_hop_weights checkpoints/checkpoint_*_*.pt \
        --data-bin data-bin --split valid --output-prefix fusion_over_training
"""
from typing import List, Sequence, Tuple

import numpy as np
import torch

from mlmha_fairseq.cli import _support as cli_support
from mlmha_fairseq.evaluation.hop_weights import (
    SIDES,
    forced_decoding_hop_weights,
    fusion_of,
    layer_labels,
    plot_hop_weights,
    plot_hop_weights_over_training,
)
from mlmha_fairseq.evaluation.model_loading import apply_bpe, encode_lines, load_model_and_state, trained_updates
from mlmha_fairseq.evaluation.text_io import InputError, check_same_length, read_lines, write_csv, write_json
from mlmha_fairseq.models.representation_fusion import DECODER

DEFAULT_PLOTS = 4
X_LABELS = ("input", "output")


def build_parser():
    parser = cli_support.make_parser(__spec__.name, __doc__)
    parser.add_argument("checkpoints", nargs="+", metavar="checkpoint",
                        help="a fairseq checkpoint of an MLRF model with SA fusion; several "
                             "checkpoints of one run: the mean weights over training")
    parser.add_argument("--data-bin", help="data directory with the dictionaries (and --split) "
                                           "(default: the one stored in the checkpoint)")
    parser.add_argument("--split", help="read the sentence pairs from this binarized split "
                                        "(e.g. test) instead of --source/--target")
    parser.add_argument("--source", help="source sentences, tokenized (and BPE-segmented unless --bpe-codes)")
    parser.add_argument("--target", help="reference translations, line-aligned with --source")
    parser.add_argument("--bpe-codes", help="subword-nmt codes to apply to --source and --target")
    parser.add_argument("--lines", type=int, nargs="+", metavar="K",
                        help="1-based sentence numbers to analyse (default: every sentence)")
    parser.add_argument("--side", choices=SIDES, default=DECODER,
                        help="the fusion whose hop weights are read (default: %(default)s)")
    parser.add_argument("--x-labels", choices=X_LABELS, default="input",
                        help="decoder side: label a position with the token fed in (y_{j-1}, the "
                             "paper's reading of Figure 5) or the token it predicts (y_j) "
                             "(default: %(default)s)")
    parser.add_argument("--plots", type=int, default=DEFAULT_PLOTS,
                        help="draw the first N analysed sentences (default: %(default)s)")
    cli_support.add_output_prefix(parser, "hop_weights")
    return parser


def chosen(total: int, numbers) -> List[int]:
    """The 1-based ``numbers`` (every sentence if None), checked against ``total``."""
    numbers = list(numbers or range(1, total + 1))
    bad = [k for k in numbers if not 1 <= k <= total]
    if bad:
        raise InputError(f"--lines {bad}: there are sentences 1..{total}")
    return numbers


def text_pairs(args, task, numbers_from) -> Tuple[List[int], List[Tuple[torch.Tensor, torch.Tensor]]]:
    if args.source is None or args.target is None:
        raise InputError("give --split, or both --source and --target")
    sources, targets = read_lines(args.source), read_lines(args.target)
    check_same_length([(args.source, sources), (args.target, targets)])
    numbers = chosen(len(sources), numbers_from)
    source_ids = encode_lines(apply_bpe([sources[k - 1] for k in numbers], args.bpe_codes),
                              task.source_dictionary)
    target_ids = encode_lines(apply_bpe([targets[k - 1] for k in numbers], args.bpe_codes),
                              task.target_dictionary)
    return numbers, list(zip(source_ids, target_ids))


def split_pairs(args, task, numbers_from) -> Tuple[List[int], List[Tuple[torch.Tensor, torch.Tensor]]]:
    try:
        task.load_dataset(args.split)
    except FileNotFoundError as error:
        raise InputError(f"split {args.split!r} not found: {error}") from error
    dataset = task.dataset(args.split)
    numbers = chosen(len(dataset), numbers_from)
    return numbers, [(dataset[k - 1]["source"], dataset[k - 1]["target"]) for k in numbers]


def strings(dictionary, ids: torch.Tensor) -> List[str]:
    return [dictionary[index] for index in ids.tolist()]


def x_tokens(side: str, x_labels: str, source: List[str], target: List[str], eos: str) -> List[str]:
    """Labels of the positions: source tokens, or the decoder's input (``</s> y_1 ..``) or
    output (``y_1 .. </s>``) tokens."""
    if side != DECODER:
        return source
    return target if x_labels == "output" else [eos] + target[:-1]


def hop_weights(parser, args) -> None:
    if args.plots < 0:
        raise InputError(f"--plots {args.plots} must be >= 0")
    if args.split and (args.source or args.target):
        raise InputError("give either --split or --source/--target, not both")
    if len(args.checkpoints) > 1:
        return hop_weights_over_training(args)
    model, task, _state = load_model_and_state(args.checkpoints[0], args.data_bin)
    numbers, pairs, weights, layers = analyse(args, model, task)
    sentences, rows = [], []
    for number, (source, target), sentence_weights in zip(numbers, pairs, weights):
        source_words = strings(task.source_dictionary, source)
        target_words = strings(task.target_dictionary, target)
        tokens = x_tokens(args.side, args.x_labels, source_words, target_words,
                          task.target_dictionary.eos_word)
        sentences.append({"line": number, "source": source_words, "target": target_words,
                          "positions": tokens, "weights": sentence_weights.tolist()})
        rows.extend(csv_rows(number, tokens, layers, sentence_weights))
    mean = mean_weights(weights)
    write_json(args.output_prefix + ".json", {
        "checkpoint": args.checkpoints[0], "side": args.side, "x_labels": args.x_labels,
        "layers": layers, "hops": int(mean.shape[0]), "mean_weights": mean.tolist(),
        "sentences": sentences,
    })
    write_csv(args.output_prefix + ".csv", rows)
    for sentence, sentence_weights in list(zip(sentences, weights))[: args.plots]:
        plot_hop_weights(sentence_weights, layers, sentence["positions"],
                         f"{args.output_prefix}_line{sentence['line']}.png", f"line {sentence['line']}")
    print(f"{len(sentences)} sentences; mean hop weights over {len(layers)} layers "
          f"({' '.join(layers)}):")
    for hop, row in enumerate(mean, start=1):
        print(f"hop {hop}: " + " ".join(f"{w:.3f}" for w in row))


def analyse(args, model, task):
    """The chosen sentence numbers and pairs, their hop weights (n_hop x K x T each) and the
    layer labels of ``args.side``."""
    fusion = fusion_of(model, args.side)
    read_pairs = split_pairs if args.split else text_pairs
    numbers, pairs = read_pairs(args, task, args.lines)
    weights = forced_decoding_hop_weights(model, pairs, task.target_dictionary.eos(), args.side)
    return numbers, pairs, weights, layer_labels(fusion)


def hop_weights_over_training(args) -> None:
    """Each checkpoint's mean weights (hop x layer) on the same sentences, in update order."""
    points, layers = [], None
    for path in args.checkpoints:
        model, task, state = load_model_and_state(path, args.data_bin)
        numbers, _pairs, weights, checkpoint_layers = analyse(args, model, task)
        if layers not in (None, checkpoint_layers):
            raise InputError(f"{path} fuses layers {' '.join(checkpoint_layers)}, the others "
                             f"{' '.join(layers)}: give checkpoints of one model")
        layers = checkpoint_layers
        points.append((trained_updates(state), path, mean_weights(weights)))
    points.sort(key=lambda point: point[0])
    means = np.stack([mean for _updates, _path, mean in points])  # checkpoints x n_hop x K
    updates = [point[0] for point in points]
    write_json(args.output_prefix + ".json", {
        "side": args.side, "layers": layers, "hops": int(means.shape[1]), "sentences": len(numbers),
        "checkpoints": [{"checkpoint": path, "updates": n, "mean_weights": mean.tolist()}
                        for n, path, mean in points],
    })
    write_csv(args.output_prefix + ".csv", [
        {"checkpoint": path, "updates": n, "hop": hop + 1, "layer": layer, "weight": float(mean[hop, index])}
        for n, path, mean in points for hop in range(mean.shape[0]) for index, layer in enumerate(layers)])
    plot_hop_weights_over_training(updates, means, layers, args.output_prefix + ".png")
    print(f"{len(points)} checkpoints, {len(numbers)} sentences; mean weight over hops per layer "
          f"({' '.join(layers)}):")
    for n, _path, mean in points:
        print(f"update {n}: " + " ".join(f"{w:.3f}" for w in mean.mean(axis=0)))


def mean_weights(weights: Sequence[np.ndarray]) -> np.ndarray:
    """Average over every position of every sentence: n_hop x K."""
    return np.concatenate(weights, axis=-1).mean(axis=-1)


def csv_rows(number: int, tokens: Sequence[str], layers: Sequence[str], weights: np.ndarray):
    for position, token in enumerate(tokens):
        for hop in range(weights.shape[0]):
            for index, layer in enumerate(layers):
                yield {"line": number, "position": position, "token": token, "hop": hop + 1,
                       "layer": layer, "weight": float(weights[hop, index, position])}


def main(argv=None) -> None:
    cli_support.run(build_parser(), hop_weights, argv)


if __name__ == "__main__":
    cli_support.command(main)
