r"""Score a system with one of the documents' protocols; prints sacreBLEU's line and signature.

Examples::

    python -m mlmha_fairseq.cli.score gen.out --input-format generate --protocol sacrebleu \
        --ref newstest2014.de
    python -m mlmha_fairseq.cli.score hyp.en --protocol multi-bleu-lc --ref test.en
"""
import json

from mlmha_fairseq.cli import _support as cli_support
from mlmha_fairseq.evaluation.scoring import corpus_score, load_hypotheses, load_references


def build_parser():
    parser = cli_support.make_parser(__spec__.name, __doc__, cli_support.protocols_epilog())
    parser.add_argument("hypotheses", help="hypothesis file (plain text or fairseq-generate output)")
    cli_support.add_text_options(parser)
    parser.add_argument("--json", action="store_true", help="print a JSON object instead")
    return parser


def score(_parser, args) -> None:
    protocol = cli_support.protocol_from_args(args)
    options = cli_support.text_options_from_args(args)
    hypotheses = load_hypotheses(args.hypotheses, protocol, options)
    generate_path = args.hypotheses if args.input_format == "generate" else None
    references = load_references(args.ref, generate_path, options)
    result = corpus_score(hypotheses, references, protocol)
    if args.json:
        print(json.dumps({"protocol": result.protocol, "score": result.score,
                          "signature": result.signature, "line": result.line}, ensure_ascii=False))
    else:
        print(result.line)


def main(argv=None) -> None:
    cli_support.run(build_parser(), score, argv)


if __name__ == "__main__":
    main()
