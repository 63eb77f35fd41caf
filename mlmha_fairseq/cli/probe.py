r"""Probing classifiers on frozen encoder features (thesis §4.5.4 and §5.6.1, SentEval probing
tasks).

Example::

    python -m mlmha_fairseq.cli.probe base.pt ms1.pt --names Transformer MS-1 \
        --data-bin data-bin/iwslt15_en_vi --bpe-codes bpe.codes \
        --tasks probing/sentence_length.txt probing/bigram_shift.txt
"""
import math
import os

import numpy as np
from tqdm import tqdm

from mlmha_fairseq.cli import _support as cli_support
from mlmha_fairseq.evaluation.model_loading import (
    DEFAULT_BATCH_SIZE,
    apply_bpe,
    batches,
    encode_lines,
    left_pad_source,
    load_model,
)
from mlmha_fairseq.evaluation.plotting import plot_probing
from mlmha_fairseq.evaluation.probing import (
    CLASSIFIERS,
    DEFAULT_THESIS_CHAPTER,
    SPLITS,
    THESIS_MLP_SCHEDULES,
    encoder_features,
    fit_probe,
    read_senteval,
)
from mlmha_fairseq.evaluation.text_io import write_csv, write_json

PERCENT = 100.0
DEFAULT_SEED = 1


def build_parser():
    parser = cli_support.make_parser(__spec__.name, __doc__)
    parser.add_argument("checkpoints", nargs="+", help="fairseq checkpoints whose encoders are probed")
    parser.add_argument("--names", nargs="+", help="one name per checkpoint")
    parser.add_argument("--tasks", nargs="+", required=True,
                        help="SentEval probing files: split<TAB>label<TAB>sentence, split in tr/va/te")
    parser.add_argument("--data-bin", help="data directory with the dictionaries "
                                           "(default: the one stored in the checkpoint)")
    parser.add_argument("--bpe-codes", help="subword-nmt codes applied to the (tokenized) sentences")
    parser.add_argument("--layer", type=int,
                        help="encoder state to pool: 0 = embeddings, k = layer k "
                             "(default: the encoder output)")
    parser.add_argument("--classifier", choices=CLASSIFIERS, default="mlp",
                        help="the thesis' two-layer MLP (RMSProp, early stopping on dev) or "
                             "logistic regression (default: %(default)s)")
    parser.add_argument("--thesis-chapter", type=int, choices=sorted(THESIS_MLP_SCHEDULES),
                        default=DEFAULT_THESIS_CHAPTER,
                        help="MLP learning rate and batch size of thesis chapter 4 (1e-3, 512) "
                             "or 5 (2.5e-4, 64) (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE,
                        help="sentences per batch (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="classifier seed (default: %(default)s)")
    cli_support.add_output_prefix(parser, "probing")
    return parser


def _task_name(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0]


def _features(model, task, sentences, args):
    dictionary = task.source_dictionary
    tokens = encode_lines(apply_bpe(sentences, args.bpe_codes), dictionary)
    progress = tqdm(batches(tokens, dictionary, args.batch_size, left_pad_source(task)),
                    total=math.ceil(len(tokens) / args.batch_size), leave=False)
    return encoder_features(model, progress, dictionary.pad(), args.layer)


def probe(parser, args) -> None:
    names = cli_support.system_names(parser, args.checkpoints, args.names)
    tasks = [(_task_name(path), read_senteval(path)) for path in args.tasks]
    rows = []
    accuracies = {name: [] for name in names}
    for name, checkpoint in zip(names, args.checkpoints):
        model, fairseq_task = load_model(checkpoint, args.data_bin)
        for task_name, data in tasks:
            features = {split: _features(model, fairseq_task, data.sentences[split], args)
                        for split in SPLITS}
            result = fit_probe(features, data.labels, args.classifier, args.seed, args.thesis_chapter)
            rows.append({"model": name, "task": task_name, "setting": result.setting,
                         "dev_accuracy": PERCENT * result.dev_accuracy,
                         "test_accuracy": PERCENT * result.test_accuracy})
            accuracies[name].append(PERCENT * result.test_accuracy)
            print(f"{name}\t{task_name}\tdev {PERCENT * result.dev_accuracy:.2f}\t"
                  f"test {PERCENT * result.test_accuracy:.2f}\t({result.setting})")
        print(f"{name}\tAVG\ttest {np.mean(accuracies[name]):.2f}")
    write_csv(args.output_prefix + ".csv", rows)
    write_json(args.output_prefix + ".json", {"classifier": args.classifier, "layer": args.layer,
                                              "thesis_chapter": args.thesis_chapter, "results": rows})
    plot_probing([name for name, _ in tasks], accuracies, args.output_prefix + ".png")


def main(argv=None) -> None:
    cli_support.run(build_parser(), probe, argv)


if __name__ == "__main__":
    cli_support.command(main)
