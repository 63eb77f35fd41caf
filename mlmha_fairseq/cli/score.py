r"""Score a system with one of the documents' protocols; prints sacreBLEU's line and signature,
then COMET's score (with ``--comet-model`` and ``--source``; n/a otherwise).

Examples::

    python -m mlmha_fairseq.cli.score gen.out --input-format generate --protocol sacrebleu \
        --ref newstest2014.de
    python -m mlmha_fairseq.cli.score hyp.en --protocol multi-bleu-lc --ref test.en
    python -m mlmha_fairseq.cli.score hyp.en --protocol chrf++ --ref test.en \
        --source test.de --comet-model wmt22-comet-da
"""
import json

from mlmha_fairseq.cli import _support as cli_support
from mlmha_fairseq.errors import UsageError
from mlmha_fairseq.evaluation.comet import NOT_GIVEN, Comet, single_reference
from mlmha_fairseq.evaluation.scoring import corpus_score, load_hypotheses, load_references
from mlmha_fairseq.evaluation.text_io import read_lines


def build_parser():
    parser = cli_support.make_parser(__spec__.name, __doc__, cli_support.protocols_epilog())
    parser.add_argument("hypotheses", help="hypothesis file (plain text or fairseq-generate output)")
    cli_support.add_text_options(parser)
    cli_support.add_comet_model(parser, " and --source")
    parser.add_argument("--source", help="the raw source sentences, one per line (COMET reads them)")
    parser.add_argument("--json", action="store_true", help="print a JSON object instead")
    return parser


def score(_parser, args) -> None:
    if args.comet_model and not args.source:
        raise UsageError("--comet-model needs --source FILE, the raw source sentences of the test set")
    protocol = cli_support.protocol_from_args(args)
    options = cli_support.text_options_from_args(args)
    hypotheses = load_hypotheses(args.hypotheses, protocol, options)
    generate_path = args.hypotheses if args.input_format == "generate" else None
    references = load_references(args.ref, generate_path, options)
    result = corpus_score(hypotheses, references, protocol)
    comet = None
    if args.comet_model:
        comet = Comet(args.comet_model).score(read_lines(args.source), hypotheses, single_reference(references))
    if args.json:
        record = {"protocol": result.protocol, "score": result.score, "signature": result.signature,
                  "line": result.line, "comet": None if comet is None else comet.score}
        record.update({"comet_model": args.comet_model} if comet else {"comet_note": NOT_GIVEN})
        print(json.dumps(record, ensure_ascii=False))
    else:
        print(result.line)
        print(f"COMET = {NOT_GIVEN}" if comet is None else f"COMET = {comet.score:.2f} (model {args.comet_model})")


def main(argv=None) -> None:
    cli_support.run(build_parser(), score, argv)


if __name__ == "__main__":
    cli_support.command(main)
