"""Experiment runner: a grid of systems x training seeds from a TOML file, each run trained
with ``fairseq-train``, decoded with ``fairseq-generate``, detokenized and scored, then one
MultEval-style table (mean ± sd over seeds, s_sel, approximate randomization over the
replicates with Holm-adjusted p-values, sacreBLEU's paired bootstrap per seed; chrF, METEOR,
chrF++, TER, and COMET with ``--comet-model DIR``; parameters, training time and tokens/s; each
difference with its estimated human accuracy) as Markdown, LaTeX, JSON and PNG.

Resumable: a run whose scores are written is skipped; a run that was stopped resumes from
its ``checkpoint_last.pt`` (fairseq-train's own restore); a run that fails is reported and the
others go on (exit status 1 at the end, as when no run of the baseline has finished and so no
table is written). Every command is printed with its log file and appended to
``<work_dir>/commands.log``.

``--records DIR`` keeps each finished run's scores, hypotheses and training log in DIR and
restores the runs recorded there that the work directory lacks
(:mod:`mlmha_fairseq.experiments.records`): a grid split over machines, or trained in rounds on
machines that do not keep their disks, reports every recorded run.

Usage: ``python -m mlmha_fairseq.cli.experiment CONFIG [--seeds N | --seeds 2-3] [--work-dir DIR] [--jobs N]
[--records DIR]``;
``--jobs N`` trains N runs at a time (on a GPU machine one per visible GPU by default, each
given its own through ``CUDA_VISIBLE_DEVICES``), with the same results as one at a time;
``examples/experiment/demo.toml`` is the quick demo's grid with 3 seeds. Config keys::

    work_dir = "work-experiment"  # runs/, logs/, results.* (relative to the current folder)
    seeds = [1, 2, 3]  # or a count: 3 = seeds 1..3
    baseline = "transformer"  # default: the first system
    systems = ["transformer", "mlmha M-00",  # names of mlmha_fairseq.experiments.systems
               { name = "M-00 no dropout", base = "mlmha M-00", args = ["--dropout", "0"] },
               { name = "my system", arch = "slot_transformer", args = ["--layer-aggregation", "s-agg"] },
               # a multi-source system over N-way data (all sources of its [corpus])
               { name = "es+fr serial", strategy = "serial", sources = ["es", "fr"] }]
    max_update = 400
    beam = 4
    max_tokens = 4096  # or batch_size = 96 (sentences)
    average_last = 0  # k > 0: decode the average of the last k update checkpoints
    save_interval_updates = 100  # default: max_update / 4
    lr = 2e-3  # Adam's peak learning rate (inverse square root schedule)
    warmup_updates = 80  # default: max_update / 5
    model_args = [...]  # default: the demo's model (d=128, 3+3 layers)
    train_args = []  # added to every fairseq-train command (with "--bf16": mlmha_fairseq.cli.train)
    generate_args = []  # added to every fairseq-generate command
    matched = ["mlmha M-00"]  # or true (every system but the baseline): each also gets the baseline
    # with as many parameters (within 1 %), trained and compared like any system
    matched_by = "ffn"  # widen the FFN (default); "layers": add layers, then close with the FFN

    [corpus]  # an existing mlmha_fairseq.cli.build_corpus output ...
    dir = "work-demo/corpus-fr"
    # ... or the Bible corpus to build (into work_dir/corpus-<sources> unless dir is given)
    sources = ["fr"]
    target = "en"
    train_verses = 10000
    bpe_merges = 4000

    [corpus]  # or your raw parallel text: raw/{train,valid,test}.{de,en}, one sentence per line;
    raw = "raw"  # tokenized (sacremoses), joint BPE (subword-nmt), binarized (fairseq-preprocess)
    sources = ["de"]  # once, into dir (default work_dir/corpus-de-en), with a manifest
    target = "en"
    bpe_merges = 10000

    [corpus]  # or an existing fairseq data-bin
    data_bin = "data-bin/iwslt14.tokenized.de-en"
    sources = ["de"]
    target = "en"
    test_references = "raw/test.en"  # raw (untokenized) references: what the score compares with
    test_sources = "raw/test.de"  # raw test sources, read by COMET (--comet-model) only
    postprocess = "subword_nmt"  # fairseq-generate --remove-bpe; or "sentencepiece", "none"
    detokenize = true  # Moses-detokenize hypotheses (false: they already are plain text)

Every corpus is checked before anything is written: a missing split, misaligned files, a
dictionary that does not match its data, references of another length are refused in one line
naming the file.

    [convergence]  # train to convergence: max_update becomes the cap
    validate_every = 200  # validation BLEU and loss every K updates (the learning curve)
    patience = 5  # stop once validation BLEU has not improved for P evaluations (0: never)
    metric = "bleu"  # or "loss": patience and checkpoint_best.pt follow the validation loss

With ``[convergence]`` the decoded checkpoint is the one of best validation BLEU (or loss; or the average
of the last ``average_last`` checkpoints), and the report adds the learning curves
(``results-curves.png``: validation BLEU and loss per system, mean and seed band), the update
at which each seed stopped, and the systems compared at matched updates
(``results-curves.{md,json}``).
"""

from mlmha_fairseq.cli import _support as cli_support
from mlmha_fairseq.errors import lab_imports

with lab_imports(__name__):  # the corpus builder's sacremoses and subword-nmt
    from mlmha_fairseq.experiments.runner import run


def parse_args(argv=None):
    parser = cli_support.make_parser(__spec__.name, __doc__)
    parser.add_argument("config", help="TOML file: systems, seeds, corpus, budget (see the module's docstring)")
    parser.add_argument("--seeds", type=cli_support.seed_count_or_list,
                        help="N: seeds 1..N; or seeds and ranges such as 2,3 or 2-3 (2-2: seed 2 alone); overrides the file's seeds")
    parser.add_argument("--work-dir", help="overrides the file's work_dir")
    parser.add_argument("--max-update", type=cli_support.positive_int, help="overrides the file's max_update")
    parser.add_argument("--jobs", type=cli_support.positive_int,
                        help="runs trained at a time (default: one per visible GPU, or 1 on the CPU); each is its "
                             "own fairseq-train, in its own run folder")
    parser.add_argument("--threads", type=cli_support.positive_int,
                        help="intra-op threads per run (OMP_NUM_THREADS; default: the CPU cores / --jobs)")
    parser.add_argument("--records", metavar="DIR",
                        help="keep every finished run's scores, test hypotheses and training log in DIR (an existing "
                             "folder, e.g. in your repository), and restore the runs recorded there that the work "
                             "directory lacks: seeds trained on other machines, or on one that lost its disk")
    parser.add_argument("--rebuild-corpus", action="store_true",
                        help="build the corpus again where its folder holds one built from other input or settings "
                             "(refused otherwise: its runs were trained on it)")
    parser.add_argument("--report-only", action="store_true",
                        help="write the table of the runs finished so far; train nothing")
    parser.add_argument("--ar-trials", type=cli_support.positive_int, default=10000, help="approximate randomization trials (default: %(default)s)")
    parser.add_argument("--bootstrap-samples", type=cli_support.positive_int, default=1000,
                        help="bootstrap resamples for s_sel and the paired bootstrap (default: %(default)s)")
    cli_support.add_comet_model(parser, " with the raw test sentences of the first source language (a data_bin "
                                        "corpus: [corpus] test_sources)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    cli_support.command(main)
