"""The documents' scoring protocols on top of sacreBLEU.

Protocols (as each paper reports its BLEU: Ampomah et al. 2020, Wang et al. 2018, the
thesis, Cui et al. 2019 and Libovický et al. 2018):

- ``sacrebleu``: detokenized, case-sensitive sacreBLEU with the 13a tokenizer, the
  equivalent of ``mteval-v13a.pl`` (MLMHA/thesis En-De).
- ``sacrebleu-tokenized-input``: the same metric applied to pre-tokenized text as it is
  (MLMHA/thesis En-Vi on the Stanford files).
- ``sacrebleu-lc``: case-insensitive 13a, several references allowed
  (MLRF Zh-En, ``mteval-v13a.pl`` with 4 references).
- ``multi-bleu``: tokenized, case-sensitive BLEU as ``multi-bleu.perl`` computes it:
  whitespace tokens, no smoothing (MLMHA/thesis Es-En, Ro/Fr-En).
- ``multi-bleu-lc``: the same, lowercased (``multi-bleu.perl -lc``: thesis/MLRF De-En,
  MMA IWSLT14 and Multi30k). Like the perl script, which reads bytes and lowercases with
  perl's ``lc``, only A-Z are lowercased: "Über" and "über" differ.
- ``chrf``: sacreBLEU's chrF2 on detokenized text.
- ``chrf++``: sacreBLEU's chrF++ (chrF2 with word unigrams and bigrams, ``CHRF(word_order=2)``)
  on detokenized text; none of the documents reports it, 2026 papers do.
- ``ter``: sacreBLEU's TER (tercom tokenization, case-insensitive as sacreBLEU's default) on
  detokenized text; lower is better. None of the documents reports it either.

Each protocol says which fairseq-generate line it reads: ``D`` (detokenized) or ``H``
(tokenized, after ``--remove-bpe``).
"""
import string
from dataclasses import dataclass, replace
from typing import List, Optional, Sequence

from sacrebleu.metrics import BLEU, CHRF, TER

from mlmha_fairseq.evaluation.generate_output import read_generate_output, remove_bpe
from mlmha_fairseq.evaluation.text_io import InputError, check_same_length, read_lines

METRICS = ("bleu", "chrf", "chrf++", "ter")
HYP_FIELDS = ("D", "H")
INPUT_FORMATS = ("plain", "generate")
# multi-bleu.perl -lc lowercases with perl's lc on undecoded bytes: A-Z only.
ASCII_LOWERCASE = str.maketrans(string.ascii_uppercase, string.ascii_lowercase)


@dataclass(frozen=True)
class Protocol:
    """How a corpus score is computed: metric, sacreBLEU tokenizer, casing, smoothing,
    and which fairseq-generate line holds the hypothesis. ``ascii_lowercase``: when
    ``lowercase``, lowercase A-Z only, as ``multi-bleu.perl -lc`` does."""

    name: str
    metric: str
    tokenize: str
    lowercase: bool
    smooth_method: str
    hyp_field: str
    description: str
    ascii_lowercase: bool = False


PROTOCOLS = {
    protocol.name: protocol
    for protocol in (
        Protocol("sacrebleu", "bleu", "13a", False, "exp", "D",
                 "detokenized case-sensitive sacreBLEU 13a (= mteval-v13a.pl); MLMHA/thesis En-De"),
        Protocol("sacrebleu-tokenized-input", "bleu", "13a", False, "exp", "H",
                 "sacreBLEU 13a on pre-tokenized text as it is; MLMHA/thesis En-Vi"),
        Protocol("sacrebleu-lc", "bleu", "13a", True, "exp", "D",
                 "case-insensitive sacreBLEU 13a (= mteval-v13a.pl -lc), multi-reference; MLRF Zh-En"),
        Protocol("multi-bleu", "bleu", "none", False, "none", "H",
                 "tokenized case-sensitive BLEU (= multi-bleu.perl); MLMHA/thesis Es-En, Ro/Fr-En",
                 ascii_lowercase=True),
        Protocol("multi-bleu-lc", "bleu", "none", True, "none", "H",
                 "tokenized BLEU, A-Z lowercased (= multi-bleu.perl -lc); thesis/MLRF De-En, "
                 "MMA IWSLT14", ascii_lowercase=True),
        Protocol("chrf", "chrf", "none", False, "none", "D",
                 "sacreBLEU chrF2 on detokenized text"),
        Protocol("chrf++", "chrf++", "none", False, "none", "D",
                 "sacreBLEU chrF++ (CHRF(word_order=2)) on detokenized text"),
        # sacreBLEU's TER is case-insensitive unless asked otherwise; the protocol keeps that default
        Protocol("ter", "ter", "none", True, "none", "D",
                 "sacreBLEU TER (tercom tokenization, case-insensitive) on detokenized text; lower is better"),
    )
}
DEFAULT_PROTOCOL = "sacrebleu"


def resolve_protocol(name: str, metric: Optional[str] = None, tokenize: Optional[str] = None,
                     lowercase: Optional[bool] = None, hyp_field: Optional[str] = None) -> Protocol:
    """A named protocol with optional per-field overrides (``None`` keeps the preset)."""
    if name not in PROTOCOLS:
        raise InputError(f"unknown protocol {name!r}; choose from {', '.join(PROTOCOLS)}")
    overrides = {"metric": metric, "tokenize": tokenize, "lowercase": lowercase,
                 "hyp_field": hyp_field}
    return replace(PROTOCOLS[name], **{k: v for k, v in overrides.items() if v is not None})


class AsciiLowercaseBLEU(BLEU):
    """sacreBLEU's BLEU lowercasing A-Z only, as ``multi-bleu.perl -lc`` does (sacreBLEU
    lowercases every script with ``str.lower``); its signature says ``case:lc``."""

    def _preprocess_segment(self, sent: str) -> str:
        return self.tokenizer(sent.translate(ASCII_LOWERCASE).rstrip())


def build_metric(protocol: Protocol):
    """The sacreBLEU metric object implementing ``protocol``."""
    if protocol.metric in ("chrf", "chrf++"):
        return CHRF(word_order=2 if protocol.metric == "chrf++" else 0, lowercase=protocol.lowercase)
    if protocol.metric == "ter":
        return TER(case_sensitive=not protocol.lowercase)
    # force=True: tokenized protocols score already tokenized text on purpose.
    bleu = AsciiLowercaseBLEU if protocol.lowercase and protocol.ascii_lowercase else BLEU
    return bleu(lowercase=protocol.lowercase, tokenize=protocol.tokenize,
                smooth_method=protocol.smooth_method, force=True)


@dataclass
class CorpusScore:
    """A corpus-level score with the exact sacreBLEU signature that produced it."""

    protocol: str
    score: float
    signature: str
    line: str


def corpus_score(hypotheses: Sequence[str], references: Sequence[Sequence[str]],
                 protocol: Protocol) -> CorpusScore:
    """Score ``hypotheses`` against one or more reference streams with sacreBLEU."""
    check_same_length([("hypotheses", hypotheses)]
                      + [(f"references #{i + 1}", r) for i, r in enumerate(references)])
    metric = build_metric(protocol)
    result = metric.corpus_score(list(hypotheses), [list(r) for r in references])
    signature = str(metric.get_signature())
    return CorpusScore(protocol=protocol.name, score=result.score, signature=signature,
                       line=result.format(signature=signature))


def detokenize(lines: Sequence[str], language: str) -> List[str]:
    """Moses detokenization (sacremoses), for generate output decoded without ``--tokenizer``."""
    from sacremoses import MosesDetokenizer

    detokenizer = MosesDetokenizer(lang=language)
    return [detokenizer.detokenize(line.split()) for line in lines]


@dataclass
class TextOptions:
    """How hypothesis/reference text is read and post-processed before scoring."""

    input_format: str = "plain"
    bpe_symbol: Optional[str] = None
    detokenize_lang: Optional[str] = None


def _postprocess(lines: List[str], options: TextOptions) -> List[str]:
    lines = remove_bpe(lines, options.bpe_symbol)
    if options.detokenize_lang:
        lines = detokenize(lines, options.detokenize_lang)
    return lines


def load_hypotheses(path: str, protocol: Protocol, options: TextOptions) -> List[str]:
    """Hypotheses of one system from a plain file or the protocol's fairseq-generate line."""
    if options.input_format == "generate":
        lines = read_generate_output(path).field(protocol.hyp_field, path)
    else:
        lines = read_lines(path)
    return _postprocess(lines, options)


def load_references(ref_paths: Sequence[str], generate_path: Optional[str],
                    options: TextOptions) -> List[List[str]]:
    """Reference streams: the given files (unchanged, as sacreBLEU expects raw references),
    or the T- lines of a fairseq-generate output post-processed like the hypotheses."""
    if ref_paths:
        return [read_lines(path) for path in ref_paths]
    if generate_path is None:
        raise InputError("no references: give --ref files or a fairseq-generate output with T- lines")
    return [_postprocess(read_generate_output(generate_path).field("T", generate_path), options)]
