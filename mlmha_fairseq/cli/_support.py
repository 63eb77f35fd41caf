"""Argparse options and error handling shared by the ``mlmha_fairseq.cli`` tools."""
import argparse
import logging
import os
import re
import sys
from typing import Callable, Iterator, List, NoReturn, Optional, Sequence

from mlmha_fairseq.evaluation.scoring import (
    DEFAULT_PROTOCOL,
    HYP_FIELDS,
    INPUT_FORMATS,
    METRICS,
    PROTOCOLS,
    Protocol,
    TextOptions,
    resolve_protocol,
)
from mlmha_fairseq.errors import UsageError, format_usage_error, missing_lab_message, one_line_message
from mlmha_fairseq.output_files import refuse_overwriting_inputs

SUBWORD_NMT = "subword_nmt"


def protocols_epilog() -> str:
    """The protocol list for ``--help``."""
    lines = ["protocols:"] + [f"  {p.name:<27} {p.description}" for p in PROTOCOLS.values()]
    return "\n".join(lines)


def help_text(docstring: str) -> str:
    """A module docstring as ``--help`` shows it: reStructuredText's literal markers
    (double backquotes, a paragraph's closing ``::``) removed."""
    text = docstring.strip().replace("``", "")
    return re.sub(r"(\S)::$", r"\1:", re.sub(r"\s::$", "", text, flags=re.M), flags=re.M)


def make_parser(module: str, docstring: str, epilog: Optional[str] = None) -> argparse.ArgumentParser:
    """A parser whose usage line reads ``python -m MODULE`` and whose description is the
    whole module docstring (:func:`help_text`)."""
    return argparse.ArgumentParser(prog=f"python -m {module}", description=help_text(docstring),
                                   epilog=epilog,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def add_text_options(parser: argparse.ArgumentParser) -> None:
    """Options choosing the protocol and how hypothesis/reference text is read."""
    group = parser.add_argument_group("scoring protocol and input text")
    group.add_argument("--protocol", choices=sorted(PROTOCOLS), default=DEFAULT_PROTOCOL,
                       help="scoring protocol (see the list below; default: %(default)s)")
    group.add_argument("--metric", choices=METRICS, help="override the protocol's metric")
    group.add_argument("--tokenize", help="override the protocol's sacreBLEU tokenizer "
                                          "(13a, intl, none, zh, ...)")
    group.add_argument("--lowercase", action="store_true", help="case-insensitive scoring")
    group.add_argument("--hyp-field", choices=HYP_FIELDS,
                       help="fairseq-generate line to score: D (detokenized) or H (tokenized); "
                            "default: the protocol's")
    group.add_argument("--input-format", choices=INPUT_FORMATS, default="plain",
                       help="system files are plain text or fairseq-generate output "
                            "(default: %(default)s)")
    group.add_argument("--ref", nargs="+", default=[],
                       help="reference file(s); several for multi-reference BLEU. Default with "
                            "--input-format generate: the T- lines")
    group.add_argument("--remove-bpe", nargs="?", const=SUBWORD_NMT, default=None,
                       metavar="SYMBOL",
                       help="undo BPE in hypotheses (and T- references) with fairseq's rule "
                            "for SYMBOL (default when given: subword_nmt)")
    group.add_argument("--detokenize", metavar="LANG",
                       help="Moses-detokenize hypotheses (and T- references) for language LANG")


def add_comet_model(parser: argparse.ArgumentParser, needs: str) -> None:
    """``--comet-model DIR``: COMET from a local model folder (``needs``: what else it reads)."""
    parser.add_argument("--comet-model", metavar="DIR",
                        help="also score with COMET from this local model folder (hparams.yaml and "
                             f"checkpoints/model.ckpt, e.g. a snapshot of Unbabel/wmt22-comet-da){needs}; "
                             "nothing is downloaded. Without it COMET reads n/a")


def protocol_from_args(args: argparse.Namespace) -> Protocol:
    return resolve_protocol(args.protocol, metric=args.metric, tokenize=args.tokenize,
                            lowercase=True if args.lowercase else None, hyp_field=args.hyp_field)


def text_options_from_args(args: argparse.Namespace) -> TextOptions:
    return TextOptions(input_format=args.input_format, bpe_symbol=args.remove_bpe,
                       detokenize_lang=args.detokenize)


def add_output_prefix(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--output-prefix", default=default,
                        help="write PREFIX.csv, PREFIX.json and PREFIX*.png (default: %(default)s)")


def system_names(parser: argparse.ArgumentParser, paths: Sequence[str],
                 names: Optional[Sequence[str]]) -> List[str]:
    """``--names`` if given (one per file), else the file names without directory."""
    if names is None:
        names = [os.path.basename(path) for path in paths]
    if len(names) != len(paths):
        parser.error(f"--names has {len(names)} entries for {len(paths)} files")
    if len(set(names)) != len(names):
        parser.error("system names must be unique (use --names)")
    return list(names)


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s | %(name)s | %(message)s",
                        force=True)
    logging.getLogger("matplotlib").setLevel(logging.WARNING)


def _input_files(args: argparse.Namespace) -> Iterator[str]:
    """Existing files named by any argument other than the outputs."""
    for name, value in vars(args).items():
        if name in ("output", "output_prefix"):
            continue
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, str) and os.path.isfile(item):
                yield item


def check_outputs_are_not_inputs(args: argparse.Namespace) -> None:
    """Refuse an ``output`` that is one of the inputs, or an ``--output-prefix`` whose
    PREFIX.csv, PREFIX.json or PREFIX*.png is an input: no tool replaces a file it reads."""
    inputs = list(_input_files(args))
    if getattr(args, "output", None):
        refuse_overwriting_inputs(args.output, inputs)
    prefix = getattr(args, "output_prefix", None)
    if prefix:
        stem = os.path.realpath(prefix)
        for path in inputs:
            real = os.path.realpath(path)
            if real in (stem + ".csv", stem + ".json") or (real.startswith(stem) and real.endswith(".png")):
                raise UsageError(f"--output-prefix {prefix} would overwrite the input {path}; "
                                 "choose another prefix")


def command(main: Callable[[], Optional[int]]) -> NoReturn:
    """Run a tool's ``main`` as its command (``if __name__ == "__main__"``) and exit with the
    status it returns: input the package rejects (:class:`~mlmha_fairseq.errors.UsageError`),
    a checkpoint that safe loading refuses, or a lab library that is not installed (imported
    where a tool needs it), ends it with one line ``<prog>: error: ...`` and status 1 instead
    of a traceback. Here rather than in a ``sys.excepthook``, so that importing
    the package leaves other programs' hooks alone; ``main`` itself raises, for callers in
    Python."""
    try:
        status = main()
    except Exception as error:
        message = one_line_message(error, error.__traceback__) or missing_lab_message(error)
        if message is None:
            raise
        print(format_usage_error(message), file=sys.stderr)
        sys.exit(1)
    sys.exit(status)


def run(parser: argparse.ArgumentParser, body, argv=None) -> None:
    """Parse ``argv`` and call ``body(parser, args)``. Input the package rejects
    (:class:`~mlmha_fairseq.errors.UsageError`) and file system errors (which name their
    file) exit via ``parser.error``: one line, status 2, no traceback."""
    args = parser.parse_args(argv)
    setup_logging()
    try:
        check_outputs_are_not_inputs(args)
        body(parser, args)
    except (UsageError, OSError) as error:
        parser.error(" ".join(str(error).split()))


def add_sentence_selection(parser: argparse.ArgumentParser, default_seed: int, sample_note: str = "") -> None:
    """Which source sentences an analysis of checkpoints reads: ``--input`` text (with
    ``--bpe-codes``) or a binarized ``--split`` of ``--data-bin``, optionally a ``--sample``;
    read back with :func:`mlmha_fairseq.evaluation.model_loading.read_sentences`."""
    parser.add_argument("--data-bin", help="data directory with the dictionaries (and --split) "
                                           "(default: the one stored in the checkpoint)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", help="source sentences, tokenized (and BPE-segmented unless "
                                        "--bpe-codes)")
    source.add_argument("--split", help="a binarized split of the data directory, e.g. test")
    parser.add_argument("--bpe-codes", help="subword-nmt codes to apply to --input")
    parser.add_argument("--sample", type=int,
                        help=f"analyse this many random sentences (default: all{sample_note})")
    parser.add_argument("--seed", type=int, default=default_seed,
                        help="sampling seed (default: %(default)s)")


ANALYSIS_SEED = 1


def checkpoint_analysis_parser(module: str, docstring: str, checkpoints_help: str, output_prefix: str,
                               sample_note: str = "") -> argparse.ArgumentParser:
    """The parser of an analysis that compares checkpoints on the same sentences
    (``attention_stats``, ``dc_diversity``, ``aif_dependency``, which share the loop
    :func:`mlmha_fairseq.evaluation.model_loading.checkpoint_batches`): the checkpoints, their
    ``--names``, the sentences (:func:`add_sentence_selection`), ``--batch-size`` and
    ``--output-prefix``; the tool adds its own options."""
    from mlmha_fairseq.evaluation.model_loading import DEFAULT_BATCH_SIZE

    parser = make_parser(module, docstring)
    parser.add_argument("checkpoints", nargs="+", help=checkpoints_help)
    parser.add_argument("--names", nargs="+", help="one name per checkpoint")
    add_sentence_selection(parser, ANALYSIS_SEED, sample_note)
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE,
                        help="sentences per batch (default: %(default)s)")
    add_output_prefix(parser, output_prefix)
    return parser



def positive_int(text: str) -> int:
    """An argparse ``type`` for counts that must be at least 1 (updates, seeds): 0 would
    otherwise read as "not given" and silently mean the default."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def seed_count_or_list(text: str):
    """An argparse ``type`` for ``--seeds``: a count N (seeds 1..N, returned as an int), or, as
    Slurm writes job arrays, comma-separated seeds and ranges such as ``2,3``, ``2-3`` or ``2-2``
    (a list of distinct seeds), e.g. to train the seeds that another machine has not."""
    if "," not in text and "-" not in text:
        return positive_int(text)
    seeds = []
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        low = positive_int(first)
        high = positive_int(last) if last else low
        if high < low:
            raise argparse.ArgumentTypeError(f"range {part.strip()!r} runs backwards")
        seeds += range(low, high + 1)
    if len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"seeds must be distinct, got {text!r}")
    return seeds
