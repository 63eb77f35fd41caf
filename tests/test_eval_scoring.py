import json

import pytest
import sacrebleu
from compare_mt import scorers

from fixtures.synthetic_systems import corrupt, generate_output, references
from mlmha_fairseq.cli import score as score_cli
from mlmha_fairseq.evaluation.generate_output import parse_generate_lines, remove_bpe
from mlmha_fairseq.evaluation.scoring import PROTOCOLS, corpus_score, resolve_protocol
from mlmha_fairseq.evaluation.text_io import InputError, check_same_length, read_lines


def write(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


@pytest.fixture
def corpus():
    refs = references()
    cased_refs = [r.capitalize() + " ." for r in refs]
    hyps = [h.capitalize() + " ." for h in corrupt(refs, 0.3, seed=1)]
    return cased_refs, hyps


# sacreBLEU's documented example (its README, "Using SacreBLEU from Python"): two reference
# streams; the README prints BLEU = 48.53 and chrF2 = 59.73 for this system.
README_REFS = [
    ["The dog bit the man.", "It was not unexpected.", "The man bit him first."],
    ["The dog had bit the man.", "No one was surprised.", "The man had bitten the dog."],
]
README_SYSTEM = ["The dog bit the man.", "It wasn't surprising.", "The man had just bitten him."]


def test_sacrebleu_protocols_reproduce_sacrebleus_documented_example():
    assert corpus_score(README_SYSTEM, README_REFS, PROTOCOLS["sacrebleu"]).score == pytest.approx(48.53, abs=0.005)
    assert corpus_score(README_SYSTEM, README_REFS, PROTOCOLS["chrf"]).score == pytest.approx(59.73, abs=0.005)


def test_multi_bleu_protocols_equal_multi_bleu_perl_counted_by_hand():
    """multi-bleu.perl: whitespace tokens, n-gram matches clipped per sentence and summed
    over the corpus (n = 1..4), no smoothing, brevity penalty exp(1 - r/c) for a
    hypothesis length c below the reference length r; -lc lowercases both sides first."""
    hyps = ["the cat sat on the mat", "A dog barked"]
    refs = ["the cat sat on a mat", "a dog barked loudly"]
    # brevity penalty exp(1 - 10/9): c = 6 + 3 tokens, r = 6 + 4. Sentence 1 matches 5/6
    # unigrams, 3/5 bigrams, 2/4 trigrams, 1/3 4-grams; sentence 2 ("A" != "a" when cased)
    # 2/3, 1/2, 0/1, 0/0, lowercased 3/3, 2/2, 1/1, 0/0. So
    # cased:      100 exp(-1/9) (7/9 * 4/7 * 2/5 * 1/3)^(1/4) = 44.150...
    # lowercased: 100 exp(-1/9) (8/9 * 5/7 * 3/5 * 1/3)^(1/4) = 53.417...
    assert corpus_score(hyps, [refs], PROTOCOLS["multi-bleu"]).score == pytest.approx(44.1503, abs=1e-4)
    assert corpus_score(hyps, [refs], PROTOCOLS["multi-bleu-lc"]).score == pytest.approx(53.4174, abs=1e-4)


def test_tokenized_bleu_equals_compare_mt(corpus):
    refs, hyps = corpus
    ours_cased = corpus_score(hyps, [refs], PROTOCOLS["multi-bleu"]).score
    ours_lc = corpus_score(hyps, [refs], PROTOCOLS["multi-bleu-lc"]).score
    ref_tokens = [r.split() for r in refs]
    hyp_tokens = [h.split() for h in hyps]
    assert ours_cased == pytest.approx(scorers.BleuScorer().score_corpus(ref_tokens, hyp_tokens)[0])
    lowered = scorers.BleuScorer(case_insensitive=True).score_corpus(ref_tokens, hyp_tokens)[0]
    assert ours_lc == pytest.approx(lowered)


def test_signature_printed_with_score(corpus):
    refs, hyps = corpus
    result = corpus_score(hyps, [refs], PROTOCOLS["multi-bleu-lc"])
    assert "case:lc" in result.signature and "tok:none" in result.signature
    assert "smooth:none" in result.signature and result.signature in result.line


def test_multi_reference(corpus):
    refs, hyps = corpus
    other = corrupt(refs, 0.2, seed=5)
    ours = corpus_score(hyps, [refs, other], PROTOCOLS["sacrebleu-lc"]).score
    assert ours == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs, other], lowercase=True).score)


def test_resolve_protocol_overrides():
    protocol = resolve_protocol("sacrebleu", lowercase=True, hyp_field="H")
    assert protocol.lowercase and protocol.hyp_field == "H" and protocol.tokenize == "13a"
    with pytest.raises(InputError):
        resolve_protocol("nist")


def test_parse_generate_output_sorted_first_hypothesis():
    lines = ["S-1\tsrc one", "T-1\tref one", "H-1\t-0.1\thyp one", "D-1\t-0.1\tHyp one",
             "H-1\t-0.9\tworse one", "S-0\tsrc zero", "T-0\tref zero", "H-0\t-0.2\t",
             "D-0\t-0.2\t", "P-0\t-0.1", "Generate test with beam=5: BLEU4 = 1.0"]
    parsed = parse_generate_lines(lines)
    assert parsed.ids == [0, 1]
    assert parsed.field("H") == ["", "hyp one"]
    assert parsed.field("D") == ["", "Hyp one"]
    assert parsed.field("T") == ["ref zero", "ref one"]


def test_parse_generate_output_errors():
    with pytest.raises(InputError, match="no H- lines"):
        parse_generate_lines(["just text"])
    with pytest.raises(InputError, match="no T- line"):
        parse_generate_lines(["H-0\t-1\ta", "H-1\t-1\tb", "T-0\tx"])
    with pytest.raises(InputError, match="required-batch-size-multiple 1"):
        parse_generate_lines(["H-0\t-1\ta", "H-2\t-1\tb"])


def test_remove_bpe_uses_fairseq_rules():
    assert remove_bpe(["a b@@ c d@@ e@@ f"], "subword_nmt") == ["a bc def"]
    assert remove_bpe(["\u2581a b \u2581c"], "sentencepiece") == ["ab c"]


def test_bad_inputs_raise_clear_errors(tmp_path, corpus):
    refs, hyps = corpus
    with pytest.raises(InputError, match="different numbers of lines"):
        corpus_score(hyps[:-1], [refs], PROTOCOLS["sacrebleu"])
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(InputError, match="empty"):
        read_lines(str(empty))
    with pytest.raises(InputError, match="not found"):
        read_lines(str(tmp_path / "missing.txt"))
    with pytest.raises(InputError, match="no lines"):
        check_same_length([("a", []), ("b", [])])


def test_score_cli_plain_and_generate(tmp_path, capsys, corpus):
    refs, hyps = corpus
    ref = write(tmp_path / "ref.txt", refs)
    hyp = write(tmp_path / "hyp.txt", hyps)
    score_cli.main([hyp, "--ref", ref, "--json"])
    plain = json.loads(capsys.readouterr().out)
    assert plain["score"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score)
    assert plain["signature"] in plain["line"]

    order = list(range(len(hyps)))[::-1]
    gen = write(tmp_path / "gen.out", generate_output(refs, refs, hyps, order))
    score_cli.main([gen, "--input-format", "generate", "--protocol", "multi-bleu", "--json"])
    from_generate = json.loads(capsys.readouterr().out)
    expected = sacrebleu.corpus_bleu(hyps, [refs], tokenize="none", smooth_method="none", force=True)
    assert from_generate["score"] == pytest.approx(expected.score)


def test_score_cli_errors_exit_cleanly(tmp_path, capsys, corpus):
    refs, hyps = corpus
    ref = write(tmp_path / "ref.txt", refs)
    short = write(tmp_path / "short.txt", hyps[:10])
    with pytest.raises(SystemExit) as exit_info:
        score_cli.main([short, "--ref", ref])
    assert exit_info.value.code == 2
    assert "different numbers of lines" in capsys.readouterr().err
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(SystemExit):
        score_cli.main([str(empty), "--ref", ref])
    assert "empty" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["score", "significance", "length_buckets", "attention_stats",
                                  "average_checkpoints", "probe", "training_curves"])
def test_every_cli_has_help(name, capsys):
    import importlib

    module = importlib.import_module(f"mlmha_fairseq.cli.{name}")
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0
    assert f"python -m mlmha_fairseq.cli.{name}" in capsys.readouterr().out
