"""Parsing ``fairseq-generate`` / ``fairseq-interactive`` output.

fairseq prints, per sentence id ``k`` and in completion order (not input order)::

    S-k<TAB>source            (after --remove-bpe and the detokenizer, if given)
    T-k<TAB>reference         (same post-processing as S-)
    H-k<TAB>score<TAB>hyp     (after --remove-bpe, before detokenization: "tokenized")
    D-k<TAB>score<TAB>hyp     (H- passed through --tokenizer's decode: "detokenized")

With ``--nbest N`` there are N H-/D- lines per id, best first; only the first is kept.
Parsed here because neither fairseq nor the scoring libraries read this format back.
"""
from dataclasses import dataclass
from typing import Dict, List, Optional

from mlmha_fairseq.evaluation.text_io import InputError, read_lines

FIELDS_WITH_SCORE = ("H", "D")
FIELDS_WITHOUT_SCORE = ("S", "T")


@dataclass
class GenerateOutput:
    """Lines of a fairseq-generate output, sorted by sentence id.

    ``fields`` maps a field letter (S, T, H, D) to one string per id; a field that the
    output does not contain is absent.
    """

    ids: List[int]
    fields: Dict[str, List[str]]

    def field(self, letter: str, path: str = "generate output") -> List[str]:
        """The lines of one field; :class:`InputError` if the output lacks it."""
        if letter not in self.fields:
            raise InputError(f"{path} has no {letter}- lines")
        return self.fields[letter]


def _parse_line(line: str):
    prefix, _, rest = line.partition("\t")
    letter, dash, number = prefix.partition("-")
    if not dash or not number.isdigit():
        return None
    if letter in FIELDS_WITH_SCORE:
        _score, _, text = rest.partition("\t")
        return letter, int(number), text
    if letter in FIELDS_WITHOUT_SCORE:
        return letter, int(number), rest
    return None


def parse_generate_lines(lines: List[str], path: str = "generate output") -> GenerateOutput:
    """Collect the S-/T-/H-/D- lines by sentence id (first hypothesis per id)."""
    by_field: Dict[str, Dict[int, str]] = {}
    for line in lines:
        parsed = _parse_line(line)
        if parsed is None:
            continue
        letter, sentence_id, text = parsed
        by_field.setdefault(letter, {}).setdefault(sentence_id, text)
    if "H" not in by_field:
        raise InputError(f"{path} contains no H- lines; is it fairseq-generate output?")
    ids = sorted(by_field["H"])
    if ids != list(range(len(ids))):
        missing = sorted(set(range(ids[-1] + 1)) - set(ids))
        raise InputError(
            f"{path}: {len(missing)} sentence ids missing (first: {missing[0]}). fairseq-generate "
            "drops the last batch when its size is not a multiple of "
            "--required-batch-size-multiple (default 8, fairseq issue #5036): rerun it with "
            "--required-batch-size-multiple 1"
        )
    fields = {}
    for letter, texts in by_field.items():
        missing = [i for i in ids if i not in texts]
        if missing:
            raise InputError(
                f"{path}: {len(missing)} sentence ids have H- but no {letter}- line "
                f"(first: {missing[0]})"
            )
        fields[letter] = [texts[i] for i in ids]
    return GenerateOutput(ids=ids, fields=fields)


def read_generate_output(path: str) -> GenerateOutput:
    """Read and parse a fairseq-generate output file."""
    return parse_generate_lines(read_lines(path), path)


def remove_bpe(lines: List[str], symbol: Optional[str]) -> List[str]:
    """Undo subword segmentation with fairseq's own ``--post-process``/``--remove-bpe``
    rules (``subword_nmt``/``@@ ``, ``sentencepiece``, ...); ``None`` leaves lines as they are."""
    if symbol is None:
        return list(lines)
    from fairseq.data.data_utils import post_process

    return [post_process(line, symbol) for line in lines]
