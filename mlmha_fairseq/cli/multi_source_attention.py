"""Cross-attention of a multi-source model per source, and the hierarchical second-level
weights per source and decoder layer, as data and PNG heat maps.

For Libovický et al. (2018), Appendix A and Figure 2: a
teacher-forced pass over the references of a binarized split, weights averaged over heads,
padding removed, EOS kept. Example::

    python -m mlmha_fairseq.cli.multi_source_attention checkpoints/hier/checkpoint_best.pt \\
        --data-bin data-bin --split test --lines 1 42 --layer 4 --output-dir attention

writes ``attention.json`` (sources, strategy, tokens of each dumped line and, for the
hierarchical strategy, the Figure 2 means), one ``line<k>.npz`` per line (``source_<name>``:
layers x target x source-position weights per source; ``contexts``: layers x target x
sources, hierarchical only), one ``line<k>.png`` (decoder layer ``--layer``, target tokens
against the concatenated sources) and, for the hierarchical strategy,
``context_weights.csv``/``.png`` (mean second-level weight per source and decoder layer over
the first ``--max-sentences`` sentences of the split, default all).
"""
import os

import numpy as np

from mlmha_fairseq.data.multi_source_dataset import IMAGE, DataError
from mlmha_fairseq.cli import _support as cli_support
from mlmha_fairseq.evaluation.model_loading import DEFAULT_BATCH_SIZE, load_model
from mlmha_fairseq.evaluation.multi_source_attention import (
    image_tokens,
    joint_view,
    mean_context_weights,
    plot_context_weights,
    plot_joint_attention,
    record,
    sentence_weights,
    source_labels,
)
from mlmha_fairseq.evaluation.text_io import InputError, write_arrays, write_csv, write_json
from mlmha_fairseq.models.multi_source import combination_modules
from mlmha_fairseq.modules.input_combination import HIERARCHICAL

PAPER_LAYER = 4  # [paper] Appendix A shows the "fourth layer" (1-based)


def build_parser():
    parser = cli_support.make_parser(__spec__.name, __doc__)
    parser.add_argument("checkpoint", help="a multi_source_transformer checkpoint")
    parser.add_argument("--data-bin", help="data directory (default: the checkpoint's)")
    parser.add_argument("--split", default="test", help="binarized split (default: %(default)s)")
    parser.add_argument("--lines", type=int, nargs="+", default=[1], metavar="K",
                        help="1-based sentence numbers of the split to dump (default: 1)")
    parser.add_argument("--layer", type=int,
                        help=f"1-based decoder layer of the PNG heat maps (default: {PAPER_LAYER}, "
                             "or the top layer of a shallower decoder)")
    parser.add_argument("--max-sentences", type=int,
                        help="sentences averaged for the second-level means (default: all)")
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE,
                        help="sentences per forward pass (default: %(default)s)")
    parser.add_argument("--output-dir", default="multi_source_attention",
                        help="directory of the outputs (default: %(default)s)")
    parser.add_argument("--no-plots", action="store_true", help="write the data only")
    return parser


def _load(args):
    model, task = load_model(args.checkpoint, args.data_bin)
    if not getattr(model, "is_multi_source", False):
        raise InputError(f"{args.checkpoint} is not a multi-source model")
    try:
        task.load_dataset(args.split)
    except DataError as error:
        raise InputError(str(error)) from error
    return model, task


def _checked(args, size: int, num_layers: int):
    bad = [k for k in args.lines if not 1 <= k <= size]
    if bad:
        raise InputError(f"--lines {bad}: split {args.split!r} has sentences 1..{size}")
    layer = args.layer or min(PAPER_LAYER, num_layers)
    if not 1 <= layer <= num_layers:
        raise InputError(f"--layer {layer}: the decoder has layers 1..{num_layers}")
    return layer


def _weights(model, dataset, indices, kinds, pad, batch_size):
    """``{index: weights}`` for the given sentence indices."""
    weights = {}
    for start in range(0, len(indices), batch_size):
        chunk = indices[start : start + batch_size]
        batch = dataset.collater([dataset[i] for i in chunk])
        weights.update(zip(chunk, sentence_weights(record(model, batch), batch, kinds, pad)))
    return weights


def _tokens(dataset, index, kinds, dictionary):
    item = dataset[index]
    sources = [image_tokens(s.size(0)) if kind == IMAGE else [dictionary[t] for t in s.tolist()]
               for s, kind in zip(item["sources"], kinds)]
    return sources, [dictionary[t] for t in item["target"].tolist()]


def dump(parser, args) -> None:
    model, task = _load(args)
    dataset, dictionary = task.dataset(args.split), task.target_dictionary
    names, kinds = task.source_names, task.source_kinds
    layer = _checked(args, len(dataset), len(model.decoder.layers))
    strategy = combination_modules(model)[0].strategy
    hierarchical = strategy == HIERARCHICAL
    averaged = list(range(min(args.max_sentences or len(dataset), len(dataset)))) if hierarchical else []
    indices = sorted(set(averaged) | {k - 1 for k in args.lines})
    weights = _weights(model, dataset, indices, kinds, dictionary.pad(), args.batch_size)
    os.makedirs(args.output_dir, exist_ok=True)
    summary = {"checkpoint": args.checkpoint, "split": args.split, "strategy": strategy,
               "sources": names, "plot_layer": layer, "lines": []}
    for number in args.lines:
        sentence = weights[number - 1]
        sources, target = _tokens(dataset, number - 1, kinds, dictionary)
        stem = os.path.join(args.output_dir, f"line{number}")
        arrays = {f"source_{name}": w for name, w in zip(names, sentence["sources"])}
        if hierarchical:
            arrays["contexts"] = sentence["contexts"]
        write_arrays(stem + ".npz", **arrays)
        summary["lines"].append({"line": number, "target": target, "sources": dict(zip(names, sources)),
                                 "data": os.path.basename(stem) + ".npz"})
        if not args.no_plots:
            boundaries = np.cumsum([len(s) for s in sources])[:-1].tolist()
            plot_joint_attention(joint_view(sentence, layer - 1), target, source_labels(sources, names),
                                 boundaries, stem + ".png",
                                 f"{strategy}, decoder layer {layer}, line {number}")
    if hierarchical:
        means = mean_context_weights([weights[i] for i in averaged])
        summary["context_weights"] = {"sentences": len(averaged), "layers": means.tolist()}
        write_csv(os.path.join(args.output_dir, "context_weights.csv"),
                  [{"decoder_layer": layer_index, **dict(zip(names, map(float, row)))}
                   for layer_index, row in enumerate(means)])
        if not args.no_plots:
            plot_context_weights(means, names, os.path.join(args.output_dir, "context_weights.png"))
    write_json(os.path.join(args.output_dir, "attention.json"), summary)
    print(f"wrote {len(args.lines)} line(s) to {args.output_dir}")


def main(argv=None) -> None:
    cli_support.run(build_parser(), dump, argv)


if __name__ == "__main__":
    cli_support.command(main)
