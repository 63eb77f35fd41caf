"""METEOR through nltk with the WordNet 3.0 files of the pinned ``wn`` package."""
from nltk.translate.meteor_score import meteor_score

from mlmha_fairseq.evaluation.meteor import corpus_meteor, load_wordnet

# nltk's documented example (nltk.translate.meteor_score): 0.6944 with one reference
HYPOTHESIS = "It is a guide to action which ensures that the military always obeys the commands of the party"
REFERENCE = "It is a guide to action that ensures that the military will forever heed Party commands"


def test_meteor_equals_nltk_reference_value():
    wordnet = load_wordnet()
    assert wordnet.reader is not None, wordnet.reason
    assert round(corpus_meteor([HYPOTHESIS], [[REFERENCE]], wordnet) / 100, 4) == 0.6944
    assert corpus_meteor([HYPOTHESIS], [[REFERENCE]], wordnet) == 100 * meteor_score(
        [REFERENCE.split()], HYPOTHESIS.split(), wordnet=wordnet.reader)


def test_wordnet_synonyms_match():
    # "car" and "auto" share WordNet 3.0's synset car.n.01: no exact or stem match finds it
    # (nltk looks synonyms up after stemming: a word whose Porter stem differs, e.g. "automobile",
    # is not found)
    wordnet = load_wordnet()
    assert [lemma.name() for lemma in wordnet.reader.synsets("dog")[0].lemmas()][0] == "dog"
    with_synonym = corpus_meteor(["he drove the auto"], [["he drove the car"]], wordnet)
    unrelated = corpus_meteor(["he drove the tree"], [["he drove the car"]], wordnet)
    assert with_synonym > unrelated


def test_meteor_is_unavailable_without_wordnet(tmp_path):
    missing = load_wordnet(str(tmp_path))
    assert missing.reader is None and "no WordNet database" in missing.reason
    assert corpus_meteor([HYPOTHESIS], [[REFERENCE]], missing) is None
