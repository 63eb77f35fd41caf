"""The metrics 2026 papers report beside the documents' BLEU: sacreBLEU's chrF++ and TER in
``score``, ``significance`` and the replicate tables of the demo and the experiment runner,
checked against sacreBLEU's own metric objects; COMET through unbabel-comet on a tiny model
built here, checked against COMET's own ``predict``."""
import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
from sacrebleu.metrics import CHRF, TER

from fixtures.synthetic_systems import VOCAB, corrupt, references
from mlmha_fairseq.cli import score as score_cli
from mlmha_fairseq.cli import significance as significance_cli
from mlmha_fairseq.errors import UsageError
from mlmha_fairseq.evaluation import replicates
from mlmha_fairseq.evaluation.comet import NOT_GIVEN, Comet, checkpoint_path
from mlmha_fairseq.evaluation.meteor import load_wordnet
from mlmha_fairseq.evaluation.scoring import PROTOCOLS, corpus_score, resolve_protocol
from mlmha_fairseq.evaluation.significance import SignificanceOptions, compare_systems, thesis_bootstrap
from mlmha_fairseq.experiments.corpora import Corpus
from mlmha_fairseq.experiments.runner import check_comet, comet_sources

SACREBLEU = {"chrf++": lambda: CHRF(word_order=2), "ter": TER}
# what Lightning says on every COMET prediction that the tests make directly (the package's own
# predictions silence it)
pytestmark = [pytest.mark.filterwarnings("ignore:The `srun` command is available"),
              pytest.mark.filterwarnings("ignore:.*treespec.*deprecated")]


def write(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def texts():
    refs = [line.capitalize() + " ." for line in references(count=80)]
    return {"refs": refs, "sources": references(count=80, seed=9),
            "baseline": corrupt(refs, 0.4, seed=1), "better": corrupt(refs, 0.1, seed=2)}


@pytest.mark.parametrize("name", ["chrf++", "ter"])
def test_protocols_equal_sacrebleus_metric_objects(texts, name):
    metric = SACREBLEU[name]()
    expected = metric.corpus_score(texts["baseline"], [texts["refs"]])
    result = corpus_score(texts["baseline"], [texts["refs"]], PROTOCOLS[name])
    assert result.score == pytest.approx(expected.score)
    assert result.signature == str(metric.get_signature())


def test_ter_protocol_is_case_insensitive_as_sacrebleus_default():
    refs = ["The cat sat on the mat ."]
    assert corpus_score(["the CAT sat on the mat ."], [refs], PROTOCOLS["ter"]).score == 0
    cased = corpus_score(["the CAT sat on the mat ."], [refs], resolve_protocol("ter", lowercase=False))
    assert cased.score == pytest.approx(TER(case_sensitive=True).corpus_score(["the CAT sat on the mat ."],
                                                                               [refs]).score)
    assert cased.score > 0


@pytest.mark.parametrize("name", ["chrf++", "ter"])
def test_score_cli_prints_chrf_plus_plus_and_ter_with_comet_not_given(tmp_path, capsys, texts, name):
    ref = write(tmp_path / "ref.txt", texts["refs"])
    hyp = write(tmp_path / "hyp.txt", texts["better"])
    metric = SACREBLEU[name]()
    expected = metric.corpus_score(texts["better"], [texts["refs"]])
    score_cli.main([hyp, "--ref", ref, "--protocol", name, "--json"])
    record = json.loads(capsys.readouterr().out)
    assert record["score"] == pytest.approx(expected.score)
    assert record["signature"] == str(metric.get_signature())
    assert record["comet"] is None and record["comet_note"] == NOT_GIVEN
    score_cli.main([hyp, "--ref", ref, "--protocol", name])
    line, comet = capsys.readouterr().out.splitlines()
    assert line == expected.format(signature=str(metric.get_signature()))
    assert comet == "COMET = n/a (give --comet-model DIR)"


def test_score_cli_refuses_a_comet_model_that_is_no_comet_folder_in_one_line(tmp_path, capsys, texts):
    ref = write(tmp_path / "ref.txt", texts["refs"])
    hyp = write(tmp_path / "hyp.txt", texts["better"])
    folder = tmp_path / "not-comet"
    folder.mkdir()
    for extra, message in ((["--source", hyp], f"--comet-model {folder} is not a COMET model folder"),
                           ([], "--comet-model needs --source FILE")):
        with pytest.raises(SystemExit) as exit_info:
            score_cli.main([hyp, "--ref", ref, "--comet-model", str(folder), *extra])
        assert exit_info.value.code == 2
        error = capsys.readouterr().err.strip().splitlines()
        assert message in error[-1] and "Traceback" not in "\n".join(error)


@pytest.mark.parametrize("name", ["chrf++", "ter"])
def test_significance_scores_equal_sacrebleu_and_a_better_system_is_significant(texts, name):
    options = SignificanceOptions(n_samples=200, sample_size=60, ar_trials=200, seed=5)
    results, _ = compare_systems(texts["baseline"], [("better", texts["better"])], [texts["refs"]],
                                 PROTOCOLS[name], ["thesis", "sacrebleu-bs", "sacrebleu-ar"], options)
    expected = SACREBLEU[name]()
    for result in results:
        assert result.score == pytest.approx(expected.corpus_score(texts["better"], [texts["refs"]]).score)
        assert result.baseline_score == pytest.approx(expected.corpus_score(texts["baseline"], [texts["refs"]]).score)
        assert result.p_value < 0.01, result.method
    with pytest.raises(UsageError, match="BLEU only"):
        compare_systems(texts["baseline"], [("better", texts["better"])], [texts["refs"]], PROTOCOLS[name],
                        ["compare-mt"], options)


def test_thesis_bootstrap_of_ter_equals_direct_resampling(texts):
    """TER's better system has the lower score: p = 1 - the share of resamples in which the
    system with the lower TER on the full test set is strictly lower, here by direct resampling."""
    n_samples, sample_size, seed = 30, 20, 4
    # nearly the same quality, so that both systems win some resamples
    close = corrupt(texts["refs"], 0.42, seed=3)
    result, samples = thesis_bootstrap(texts["baseline"], close, [texts["refs"]], PROTOCOLS["ter"], "close",
                                       n_samples, sample_size, seed)
    indices = np.random.default_rng(seed).integers(0, len(texts["refs"]), size=(n_samples, sample_size))

    def ter(hyps, idx):
        return TER().corpus_score([hyps[i] for i in idx], [[texts["refs"][i] for i in idx]]).score

    base = np.array([ter(texts["baseline"], idx) for idx in indices])
    other = np.array([ter(close, idx) for idx in indices])
    np.testing.assert_allclose(samples.baseline, base)
    np.testing.assert_allclose(samples.system, other)
    assert 0 < (other < base).sum() < n_samples
    wins = (other < base).sum() if result.score <= result.baseline_score else (base < other).sum()
    assert result.p_value == pytest.approx(1 - wins / n_samples)


def test_significance_cli_table_for_ter(tmp_path, capsys, texts):
    paths = [write(tmp_path / f"{name}.txt", texts[name]) for name in ("baseline", "better")]
    ref = write(tmp_path / "ref.txt", texts["refs"])
    prefix = str(tmp_path / "sig")
    significance_cli.main(paths + ["--names", "base", "good", "--ref", ref, "--protocol", "ter",
                                   "--methods", "sacrebleu-bs", "--n-samples", "100", "--output-prefix", prefix])
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("| System | TER | Δ |")
    good = TER().corpus_score(texts["better"], [texts["refs"]]).score
    base = TER().corpus_score(texts["baseline"], [texts["refs"]]).score
    assert table[3].startswith(f"| good | {good:.2f}‡ | {good - base:+.2f} |")
    payload = json.loads((tmp_path / "sig.json").read_text(encoding="utf-8"))
    assert payload["protocol"] == "ter" and payload["results"][0]["score"] == pytest.approx(good)


BASELINE = {1: corrupt(references(count=30), 0.5, seed=11), 2: corrupt(references(count=30), 0.5, seed=12)}
SYSTEM = {1: corrupt(references(count=30), 0.2, seed=13), 2: corrupt(references(count=30), 0.25, seed=14)}


def test_replicate_tables_of_the_demo_and_runner_carry_chrf_plus_plus_ter_and_comet_n_a(tmp_path):
    refs = references(count=30)
    options = replicates.ReplicateOptions(bootstrap_samples=20, ar_trials=20)
    report = replicates.build_report([("base", BASELINE), ("new", SYSTEM)], [refs], options,
                                     wordnet=load_wordnet(str(tmp_path / "no-wordnet")))
    new = report.rows[1]
    assert new.scores["chrF++"] == pytest.approx([CHRF(word_order=2).corpus_score(SYSTEM[s], [refs]).score
                                                  for s in (1, 2)])
    assert new.scores["TER"] == pytest.approx([TER().corpus_score(SYSTEM[s], [refs]).score for s in (1, 2)])
    assert new.scores["COMET"] == [None, None]
    table = replicates.write_report(report, str(tmp_path / "results"), "2 updates", "toy")
    header = [cell.strip() for cell in table.splitlines()[0].strip("|").split("|")]
    row = [cell.strip() for cell in table.splitlines()[3].strip("|").split("|")]
    cells = dict(zip(header, row))
    ter = [TER().corpus_score(SYSTEM[s], [refs]).score for s in (1, 2)]
    assert cells["TER"] == f"{np.mean(ter):.2f} ± {np.std(ter, ddof=1):.2f}"
    assert cells["COMET"] == "n/a" and cells["METEOR"] == "n/a" and header[8] == "METEOR"
    assert f"TER (lower is better) {report.signatures['TER']}" in table
    assert f"COMET: {NOT_GIVEN}" in table and f"chrF++ {report.signatures['chrF++']}" in table
    chrf_plus_plus = CHRF(word_order=2)
    chrf_plus_plus.corpus_score(SYSTEM[1], [refs])  # a signature names the number of references
    assert report.signatures["chrF++"] == str(chrf_plus_plus.get_signature())
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["comet"] == NOT_GIVEN
    assert saved["systems"][1]["mean"]["chrF++"] == pytest.approx(np.mean(new.scores["chrF++"]))
    assert saved["systems"][1]["mean"]["TER"] == pytest.approx(np.mean(ter))
    assert saved["systems"][1]["mean"]["BLEU"] == pytest.approx(new.summary("BLEU")[0])  # the keys kept


def test_runner_finds_comets_sources_and_refuses_a_data_bin_without_them(tmp_path):
    folder = tmp_path / "corpus"
    (folder / "text").mkdir(parents=True)
    (folder / "manifest.json").write_text(json.dumps({"sources": ["fr"], "target": "en"}))
    write(folder / "text" / "test.raw.fr", ["Bonjour .", "Merci ."])
    corpus = Corpus(str(folder / "data-bin"), "en", str(folder / "text" / "test.raw.en"))
    assert comet_sources({"dir": str(folder)}, corpus) == ["Bonjour .", "Merci ."]
    model = tmp_path / "model"
    (model / "checkpoints").mkdir(parents=True)
    with pytest.raises(UsageError, match="is not a COMET model folder"):
        check_comet(str(model), {"data_bin": "bin", "test_references": "ref.txt"})
    (model / "hparams.yaml").write_text("class_identifier: regression_metric\n")
    (model / "checkpoints" / "model.ckpt").write_bytes(b"")
    with pytest.raises(UsageError, match="needs test_sources"):
        check_comet(str(model), {"data_bin": "bin", "test_references": "ref.txt"})
    references_file = write(tmp_path / "ref.txt", ["a", "b", "c"])
    with pytest.raises(UsageError, match="different numbers of lines"):
        check_comet(str(model), {"data_bin": "bin", "test_references": references_file,
                                 "test_sources": str(folder / "text" / "test.raw.fr")})


WORDS = [*VOCAB, "."]  # the synthetic systems' words


@pytest.fixture(scope="module")
def tiny_comet(tmp_path_factory):
    """A COMET regression model (COMET-22's architecture) with a two-layer, 16-wide XLM-R
    encoder and a word-level tokenizer over the synthetic vocabulary, random weights, saved as
    the hub stores a COMET model: hparams.yaml and checkpoints/model.ckpt."""
    pytest.importorskip("comet", reason="unbabel-comet is not installed (WITH_COMET=1 scripts/setup_venv.sh)")
    import pytorch_lightning
    import torch
    import yaml
    from comet.models import RegressionMetric
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import XLMRobertaConfig, XLMRobertaTokenizerFast

    root = tmp_path_factory.mktemp("comet")
    encoder = root / "encoder"
    vocabulary = {token: i for i, token in enumerate(["<s>", "<pad>", "</s>", "<unk>", *WORDS, "<mask>"])}
    tokenizer = Tokenizer(models.WordLevel(vocabulary, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    XLMRobertaTokenizerFast(tokenizer_object=tokenizer).save_pretrained(encoder)
    XLMRobertaConfig(vocab_size=len(vocabulary), hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=66).save_pretrained(encoder)
    torch.manual_seed(0)
    model = RegressionMetric(pretrained_model=str(encoder), load_pretrained_weights=False, local_files_only=True,
                             hidden_sizes=[8], nr_frozen_epochs=0)
    model_dir = root / "tiny-comet"
    (model_dir / "checkpoints").mkdir(parents=True)
    hparams = dict(model.hparams)
    torch.save({"state_dict": model.state_dict(), "hyper_parameters": hparams,
                "pytorch-lightning_version": pytorch_lightning.__version__}, model_dir / "checkpoints" / "model.ckpt")
    (model_dir / "hparams.yaml").write_text(yaml.safe_dump(hparams))
    return str(model_dir)


@pytest.fixture(scope="module")
def comet_texts():
    refs = references(count=12, max_words=12)
    return {"sources": references(count=12, seed=3, max_words=12), "refs": refs,
            "hyps": corrupt(refs, 0.3, seed=4)}


def comets_own(model_dir, sources, hypotheses, refs):
    """COMET's own loading and prediction, as its documentation shows them."""
    from comet import load_from_checkpoint

    model = load_from_checkpoint(checkpoint_path(model_dir), local_files_only=True)
    data = [{"src": s, "mt": h, "ref": r} for s, h, r in zip(sources, hypotheses, refs)]
    return model.predict(data, batch_size=8, gpus=0, progress_bar=False)


def test_comet_equals_comets_own_predict_and_reads_each_input_in_its_place(tiny_comet, comet_texts):
    src, hyps, refs = comet_texts["sources"], comet_texts["hyps"], comet_texts["refs"]
    ours = Comet(tiny_comet).score(src, hyps, refs)
    own = comets_own(tiny_comet, src, hyps, refs)
    assert ours.segments == pytest.approx(own.scores, abs=1e-6)
    assert ours.score == pytest.approx(100 * own.system_score, abs=1e-4)
    # the model reads all three: a swap of any two, or shuffled references, changes the scores
    shuffled = random.Random(1).sample(refs, len(refs))
    for other in (comets_own(tiny_comet, src, refs, hyps), comets_own(tiny_comet, refs, hyps, src),
                  comets_own(tiny_comet, src, hyps, shuffled)):
        assert np.max(np.abs(np.array(other.scores) - np.array(own.scores))) > 1e-4


def test_comet_in_score_and_in_the_replicate_tables(tiny_comet, comet_texts, tmp_path, capsys):
    src, hyps, refs = comet_texts["sources"], comet_texts["hyps"], comet_texts["refs"]
    expected = 100 * comets_own(tiny_comet, src, hyps, refs).system_score
    paths = {name: write(tmp_path / f"{name}.txt", lines) for name, lines in (("src", src), ("hyp", hyps),
                                                                                ("ref", refs))}
    score_cli.main([paths["hyp"], "--ref", paths["ref"], "--source", paths["src"], "--comet-model", tiny_comet,
                    "--json"])
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["comet"] == pytest.approx(expected, abs=1e-4) and record["comet_model"] == tiny_comet
    other = corrupt(refs, 0.6, seed=8)
    report = replicates.build_report([("base", {1: other}), ("new", {1: hyps})], [refs],
                                     replicates.ReplicateOptions(bootstrap_samples=10, ar_trials=10),
                                     comet=Comet(tiny_comet), sources=src)
    assert report.rows[1].scores["COMET"] == pytest.approx([expected], abs=1e-4)
    assert report.rows[0].scores["COMET"] == pytest.approx(
        [100 * comets_own(tiny_comet, src, other, refs).system_score], abs=1e-4)
    assert tiny_comet in report.comet_note


def test_a_comet_folder_whose_encoder_is_not_local_is_refused_in_one_line(tiny_comet, tmp_path):
    import shutil

    import torch

    broken = tmp_path / "broken"
    shutil.copytree(tiny_comet, broken)
    checkpoint = broken / "checkpoints" / "model.ckpt"
    state = torch.load(checkpoint, weights_only=False)
    state["hyper_parameters"]["pretrained_model"] = str(tmp_path / "no-encoder")  # what COMET builds from
    torch.save(state, checkpoint)
    with pytest.raises(UsageError, match="could not be loaded without downloading anything") as error:
        Comet(str(broken))
    assert str(broken) in str(error.value) and "\n" not in str(error.value)


def test_runner_and_demo_refuse_a_comet_model_that_is_no_comet_folder_before_anything_runs(tmp_path, capsys):
    from mlmha_fairseq.cli import demo, experiment

    not_comet = tmp_path / "not-comet"
    not_comet.mkdir()
    config = tmp_path / "grid.toml"
    config.write_text(f'work_dir = "{tmp_path / "work"}"\nsystems = ["transformer"]\n[corpus]\ndir = "corpus"\n')
    assert experiment.main([str(config), "--comet-model", str(not_comet)]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert error == [f"experiment: error: --comet-model {not_comet} is not a COMET model folder: it needs "
                     "hparams.yaml and checkpoints/model.ckpt (e.g. a local snapshot of Unbabel/wmt22-comet-da)"]
    with pytest.raises(UsageError, match=f"--comet-model {not_comet} is not a COMET model folder"):
        demo.main(["--work-dir", str(tmp_path / "demo"), "--comet-model", str(not_comet)])
    assert not (tmp_path / "work").exists() and not (tmp_path / "demo").exists()


def test_runner_table_scores_comet_against_the_corpus_source(tmp_path, tiny_comet, comet_texts):
    """``--report-only`` over two finished runs written here: the runner's table reads the
    corpus's source side for COMET."""
    from mlmha_fairseq.cli import experiment
    from mlmha_fairseq.experiments.config import load_config
    from mlmha_fairseq.experiments.grid import Grid, Settings

    src, hyps, refs = comet_texts["sources"], comet_texts["hyps"], comet_texts["refs"]
    corpus, work = tmp_path / "corpus", tmp_path / "work"
    (corpus / "text").mkdir(parents=True)
    (corpus / "manifest.json").write_text(json.dumps({"sources": ["fr"], "target": "en"}))
    write(corpus / "text" / "test.raw.fr", src)
    write(corpus / "text" / "test.raw.en", refs)
    config = tmp_path / "grid.toml"
    config.write_text(f'work_dir = "{work}"\nseeds = 1\nsystems = ["transformer", "MLMHA M-00"]\n'
                      f'[corpus]\ndir = "{corpus}"\ntarget = "en"\n')
    outputs = [corrupt(refs, 0.6, seed=8), hyps]
    for run, lines in zip(Grid(load_config(str(config)).systems, [1], Settings("", "en", 1), str(work)).runs,
                          outputs):
        os.makedirs(run.directory)
        write(Path(run.path("hypotheses.txt")), lines)
        Path(run.path("scores.json")).write_text("{}")
    assert experiment.main([str(config), "--report-only", "--comet-model", tiny_comet,
                            "--bootstrap-samples", "10", "--ar-trials", "10"]) == 0
    saved = json.loads((work / "results.json").read_text())
    for row, lines in zip(saved["systems"], outputs):
        assert row["scores"]["COMET"] == pytest.approx([100 * comets_own(tiny_comet, src, lines, refs).system_score],
                                                       abs=1e-4)
        assert row["scores"]["TER"] == pytest.approx([TER().corpus_score(lines, [refs]).score])
    assert "COMET: unbabel-comet, model" in (work / "results.md").read_text()
