"""The package's own command-line tools on bad input: one line naming the file or option,
a non-zero exit, nothing written half, no input overwritten; and the defects a new user met."""
import json
import logging
import os

import pytest
import torch

from fixtures.synthetic_systems import corrupt, references
from mlmha_fairseq.cli import attention_stats as attention_stats_cli
from mlmha_fairseq.cli import average_checkpoints as average_cli
from mlmha_fairseq.cli import score as score_cli
from mlmha_fairseq.cli import significance as significance_cli
from mlmha_fairseq.cli import strip_aux_decoders
from mlmha_fairseq.evaluation.checkpoint_averaging import save_checkpoint
from mlmha_fairseq.evaluation.plotting import plot_significance
from mlmha_fairseq.evaluation.scoring import PROTOCOLS, corpus_score
from mlmha_fairseq.evaluation.significance import thesis_bootstrap
from mlmha_fairseq.evaluation.text_io import write_json
from test_eval_averaging import minimal_state


def cli_error(main, argv, capsys):
    """The one stderr line of a CLI that rejects its input (argparse's ``parser.error``)."""
    with pytest.raises(SystemExit) as exit_info:
        main([str(arg) for arg in argv])
    assert exit_info.value.code != 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(lines)
    assert ": error: " in lines[-1]
    return lines[-1]


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


# --- scoring -----------------------------------------------------------------------

def test_multi_bleu_lc_lowercases_ascii_only_as_the_perl_script():
    """multi-bleu.perl -lc applies perl's lc to bytes: "Haus" matches "haus", "Über" does
    not match "über". Unigram 4/5, bigram 3/4, trigram 2/3, 4-gram 1/2 precision, no
    brevity penalty: BLEU = 100 * (4/5 * 3/4 * 2/3 * 1/2) ** (1/4)."""
    hypothesis, reference = ["über das haus ist klein"], ["Über das Haus ist klein"]
    score = corpus_score(hypothesis, [reference], PROTOCOLS["multi-bleu-lc"])
    assert score.score == pytest.approx(100 * (4 / 5 * 3 / 4 * 2 / 3 * 1 / 2) ** 0.25, abs=1e-9)
    assert "case:lc" in score.signature
    ascii_only = corpus_score(["das haus ist klein"], [["Das Haus ist klein"]], PROTOCOLS["multi-bleu-lc"])
    assert ascii_only.score == pytest.approx(100.0)


def test_score_of_a_file_that_is_not_utf8(tmp_path, capsys):
    hypotheses = tmp_path / "hyp.latin1"
    hypotheses.write_bytes("über alles\n".encode("latin-1"))
    reference = write_lines(tmp_path / "ref.txt", ["über alles"])
    line = cli_error(score_cli.main, [hypotheses, "--ref", reference], capsys)
    assert str(hypotheses) in line and "not UTF-8" in line


def test_attention_stats_input_that_is_not_utf8(tmp_path, capsys):
    source = tmp_path / "source.latin1"
    source.write_bytes("été\n".encode("latin-1"))
    line = cli_error(attention_stats_cli.main,
                     [tmp_path / "model.pt", "--input", source, "--output-prefix", tmp_path / "out"], capsys)
    assert str(source) in line and "not UTF-8" in line
    assert not list(tmp_path.glob("out*"))


# --- significance -------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_systems(tmp_path_factory):
    root = tmp_path_factory.mktemp("systems")
    refs = references(count=40)
    return (write_lines(root / "ref.txt", refs), write_lines(root / "base.txt", corrupt(refs, 0.4, seed=1)),
            write_lines(root / "new.txt", corrupt(refs, 0.3, seed=2)))


def test_significance_figure_with_an_interval_that_excludes_the_score(tmp_path):
    """A bootstrap interval need not contain the full test set's score (two barely trained
    systems); the figure is still drawn."""
    path = tmp_path / "significance.png"
    plot_significance(["base", "new"], [1.0, 2.0], [None, (2.5, 3.0)], ["", "†"], "BLEU", "thesis", str(path))
    assert path.read_bytes().startswith(b"\x89PNG")


def test_significance_sacrebleu_bs_with_chrf_writes_its_json(two_systems, tmp_path):
    """sacreBLEU returns numpy scalars for chrF; the JSON is written all the same."""
    ref, base, new = two_systems
    prefix = tmp_path / "chrf"
    significance_cli.main([str(base), str(new), "--ref", str(ref), "--methods", "sacrebleu-bs",
                           "--metric", "chrf", "--n-samples", "50", "--output-prefix", str(prefix)])
    result = json.loads((tmp_path / "chrf.json").read_text())["results"][0]
    assert result["method"] == "sacrebleu-bs" and 0 < result["score"] < 100
    assert (tmp_path / "chrf.png").exists() and (tmp_path / "chrf.csv").exists()


def test_a_failed_json_write_leaves_the_previous_file(tmp_path):
    path = tmp_path / "results.json"
    write_json(str(path), {"score": 1})
    with pytest.raises(TypeError):
        write_json(str(path), {"score": object()})
    assert json.loads(path.read_text()) == {"score": 1}
    assert os.listdir(tmp_path) == ["results.json"]


def test_thesis_method_warns_when_its_sample_exceeds_the_test_set(caplog):
    refs = references(count=30)
    with caplog.at_level(logging.WARNING, logger="mlmha_fairseq.evaluation.significance"):
        thesis_bootstrap(corrupt(refs, 0.3, seed=1), corrupt(refs, 0.2, seed=2), [refs],
                         PROTOCOLS["multi-bleu"], n_samples=20, sample_size=1000)
    assert "sample size 1000 exceeds the test set (30 sentences)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mlmha_fairseq.evaluation.significance"):
        thesis_bootstrap(refs, refs, [refs], PROTOCOLS["multi-bleu"], n_samples=20, sample_size=30)
    assert "exceeds" not in caplog.text


def test_an_output_prefix_that_would_overwrite_an_input(two_systems, tmp_path, capsys):
    ref, base, _new = two_systems
    system = write_lines(tmp_path / "sys.csv", base.read_text().splitlines())
    before = system.read_bytes()
    line = cli_error(significance_cli.main,
                     [base, system, "--ref", ref, "--output-prefix", tmp_path / "sys"], capsys)
    assert "--output-prefix" in line and str(system) in line
    assert system.read_bytes() == before


# --- checkpoints ------------------------------------------------------------------------

@pytest.fixture
def two_checkpoints(tmp_path):
    paths = []
    for seed in (1, 2):
        path = tmp_path / f"checkpoint{seed}.pt"
        torch.save(minimal_state(seed, 10 * seed), path)
        paths.append(path)
    return paths


def test_averaging_into_one_of_its_inputs_is_refused(two_checkpoints, capsys):
    first, second = two_checkpoints
    before = first.read_bytes()
    line = cli_error(average_cli.main, ["--inputs", first, second, "--output", first], capsys)
    assert f"the output {first} is also an input" in line
    assert first.read_bytes() == before
    directory = first.parent
    line = cli_error(average_cli.main, ["--input-dir", directory, "--num-epoch-checkpoints", "2",
                                        "--output", second], capsys)
    assert f"the output {second} is also an input" in line


@pytest.mark.parametrize("content", [b"", b"not a checkpoint at all" * 10], ids=["empty", "garbage"])
def test_a_checkpoint_that_cannot_be_read(two_checkpoints, tmp_path, capsys, content):
    broken = tmp_path / "broken.pt"
    broken.write_bytes(content)
    line = cli_error(average_cli.main, ["--inputs", two_checkpoints[0], broken, "--output",
                                        tmp_path / "average.pt"], capsys)
    assert f"checkpoint {broken}" in line
    assert not (tmp_path / "average.pt").exists()


def test_an_interrupted_checkpoint_save_leaves_the_previous_file(two_checkpoints):
    """The state is written to a temporary file renamed into place: a save that fails half
    way (here: an object torch cannot pickle) leaves the old checkpoint whole."""
    target = two_checkpoints[0]
    before = target.read_bytes()
    state = minimal_state(3, 30)
    state["extra_state"]["unpicklable"] = lambda: None
    with pytest.raises(Exception):
        save_checkpoint(state, str(target))
    assert target.read_bytes() == before
    assert sorted(p.name for p in target.parent.iterdir()) == ["checkpoint1.pt", "checkpoint2.pt"]
    save_checkpoint(minimal_state(3, 30), str(target))
    assert torch.load(target)["extra_state"]["train_iterator"]["epoch"] == 3
    assert oct(target.stat().st_mode & 0o777) == oct(0o666 & ~current_umask())


def current_umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_strip_aux_decoders_into_its_input_through_a_link_is_refused(two_checkpoints, tmp_path, capsys):
    checkpoint = two_checkpoints[0]
    link = tmp_path / "link.pt"
    link.symlink_to(checkpoint)
    before = checkpoint.read_bytes()
    line = cli_error(strip_aux_decoders.main, [checkpoint, link], capsys)
    assert f"the output {link} is also an input" in line
    assert checkpoint.read_bytes() == before


def test_a_byte_order_mark_is_not_text(tmp_path):
    """A UTF-8 byte-order mark (Windows editors write one) would be the first character of the
    first sentence, of its first token after BPE, and change BLEU; it is no text."""
    from mlmha_fairseq.evaluation.text_io import read_lines

    path = tmp_path / "refs.txt"
    path.write_bytes("\ufeffThe dog bit the man.\nIt was not surprising.\n".encode("utf-8"))
    assert read_lines(str(path)) == ["The dog bit the man.", "It was not surprising."]
