"""The experiment runner on a researcher's own data: raw parallel text (tokenized, BPE-segmented
and binarized by the runner) and an existing fairseq data-bin give the same table; each
unusable corpus is refused in one line naming the file, before anything is written."""
import json
import os
import shutil

import pytest

from fairseq_helpers import DECODING, results_rows, run_fairseq
from fixtures.tiny_bible import BPE_MERGES
from mlmha_fairseq.cli import experiment
from mlmha_fairseq.errors import UsageError
from test_demo import tiny_corpus

SPLITS = ("train", "valid", "test")
GRID = 'work_dir = "{work}"\nsystems = ["transformer"]\nmax_update = 3\nbeam = 1\n' + DECODING + '\n[corpus]\n{corpus}\n'
ARGS = ["--ar-trials", "10", "--bootstrap-samples", "10", "--threads", "1"]


@pytest.fixture(scope="module")
def raw_text(tmp_path_factory):
    """Raw French-English text in {split}.{fr,en} files (the tiny Bible's)."""
    root = tmp_path_factory.mktemp("raw")
    corpus = tiny_corpus(root, "fr")
    raw = root / "raw"
    raw.mkdir()
    for split in SPLITS:
        for side in ("fr", "en"):
            shutil.copyfile(os.path.join(corpus, "text", f"{split}.raw.{side}"), raw / f"{split}.{side}")
    return raw


def grid(tmp_path, name, corpus_lines):
    config = tmp_path / f"{name}.toml"
    config.write_text(GRID.format(work=tmp_path / name, corpus="\n".join(corpus_lines)))
    return config


def test_raw_text_and_a_fairseq_data_bin_of_it_give_the_same_table(tmp_path, raw_text):
    built = tmp_path / "built"
    raw = grid(tmp_path, "raw", [f'raw = "{raw_text}"', 'sources = ["fr"]', 'target = "en"', f'dir = "{built}"',
                                 f"bpe_merges = {BPE_MERGES}"])
    assert experiment.main([str(raw), *ARGS]) == 0
    manifest = json.loads((built / "manifest.json").read_text())
    assert manifest["sizes"]["test"] == len((raw_text / "test.en").read_text().splitlines())
    assert (built / "text" / "test.tok.fr").exists() and (built / "bpe.codes").exists()

    # what a researcher has: the same segmented text binarized by fairseq-preprocess
    data_bin = tmp_path / "data-bin"
    run_fairseq("preprocess", "--source-lang", "fr", "--target-lang", "en", "--joined-dictionary",
                *[arg for split in SPLITS for arg in (f"--{split}pref", built / "text" / split)],
                "--destdir", data_bin, "--workers", "1")
    binarized = grid(tmp_path, "bin", [f'data_bin = "{data_bin}"', 'sources = ["fr"]', 'target = "en"',
                                       f'test_references = "{raw_text / "test.en"}"'])
    assert experiment.main([str(binarized), *ARGS]) == 0
    assert results_rows(tmp_path / "raw") == results_rows(tmp_path / "bin")

    # a rerun keeps the built corpus
    before = (built / "manifest.json").stat().st_mtime_ns
    (tmp_path / "raw" / "results.json").unlink()
    assert experiment.main([str(raw), *ARGS, "--report-only"]) == 0
    assert (built / "manifest.json").stat().st_mtime_ns == before


def _missing_split(raw, data_bin, refs):
    os.remove(raw / "valid.en")
    return [f'raw = "{raw}"', 'sources = ["fr"]', 'target = "en"'], f"{raw / 'valid.en'} is missing"


def _misaligned(raw, data_bin, refs):
    with open(raw / "train.fr", "a") as handle:
        handle.write("une phrase de trop\n")
    return [f'raw = "{raw}"', 'sources = ["fr"]', 'target = "en"'], f"{raw / 'train.fr'} 34: the files of a split"


def _not_utf8(raw, data_bin, refs):
    with open(raw / "test.en", "ab") as handle:
        handle.write(b"caf\xe9\n")
    return [f'raw = "{raw}"', 'sources = ["fr"]', 'target = "en"'], f"{raw / 'test.en'} is not UTF-8 text"


def _references_of_another_length(raw, data_bin, refs):
    refs.write_text("only one line\n")
    return DATA_BIN_CORPUS(data_bin, refs), f"test_references {refs} has 1 lines, the test set of {data_bin} 16"


def _dictionary_of_other_data(raw, data_bin, refs):
    (data_bin / "dict.tgt.txt").write_text("a 1\nb 1\n")
    return DATA_BIN_CORPUS(data_bin, refs), f"but {data_bin / 'dict.tgt.txt'} has 6 entries"


def _data_bin_without_a_split(raw, data_bin, refs):
    for suffix in (".bin", ".idx"):
        os.remove(data_bin / f"valid.src-tgt.src{suffix}")
    return DATA_BIN_CORPUS(data_bin, refs), "has no valid data for src-tgt"


def DATA_BIN_CORPUS(data_bin, refs):
    """The toy reversal corpus's data-bin (languages src, tgt; 16 test sentences)."""
    return [f'data_bin = "{data_bin}"', 'sources = ["src"]', 'target = "tgt"', f'test_references = "{refs}"']


@pytest.mark.parametrize("case", [_missing_split, _misaligned, _not_utf8, _references_of_another_length,
                                  _dictionary_of_other_data, _data_bin_without_a_split],
                         ids=lambda case: case.__name__.strip("_"))
def test_an_unusable_corpus_is_refused_in_one_line_before_anything_is_written(tmp_path, raw_text, data_bin,
                                                                              capsys, case):
    raw, binarized, refs = tmp_path / "raw", tmp_path / "data-bin", tmp_path / "refs.tgt"
    shutil.copytree(raw_text, raw)
    shutil.copytree(data_bin, binarized)
    refs.write_text("reference\n" * 16)
    lines, message = case(raw, binarized, refs)
    config = grid(tmp_path, "work", lines)
    assert experiment.main([str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("experiment: error: [corpus]") and message in err[0], err
    assert not (tmp_path / "work").exists()


def test_a_multi_source_table_and_curves_on_n_way_data(tmp_path):
    """Systems given by combination strategy and sources, on an N-way corpus (es, fr -> en),
    with learning curves: the multi-source task validates by BLEU as the translation task."""
    corpus = tiny_corpus(tmp_path, "es", "fr")
    config = tmp_path / "grid.toml"
    config.write_text(f'work_dir = "{tmp_path / "work"}"\nmax_update = 2\nbeam = 1\n{DECODING}\nbatch_size = 8\nsystems = [\n'
                      '  { name = "fr only", strategy = "serial", sources = ["fr"] },\n'
                      '  { name = "es+fr hierarchical", strategy = "hierarchical", sources = ["es", "fr"] }]\n'
                      '[convergence]\nvalidate_every = 1\npatience = 5\n'
                      f'[corpus]\ndir = "{corpus}"\n')
    assert experiment.main([str(config), *ARGS]) == 0
    rows = json.loads((tmp_path / "work" / "results.json").read_text())["systems"]
    assert [row["name"] for row in rows] == ["fr only", "es+fr hierarchical"]
    trainings = [line for line in (tmp_path / "work" / "commands.log").read_text().splitlines() if "train" in line]
    assert "--source-langs es,fr" in trainings[1] and "--combination-strategy hierarchical" in trainings[1]
    assert all("--eval-bleu" in line for line in trainings)
    curves = json.loads((tmp_path / "work" / "results-curves.json").read_text())["seeds"]
    for name in ("fr only", "es+fr hierarchical"):
        assert curves[name]["1"]["validations"] == 2  # one validation BLEU per update


def test_a_corpus_folder_holding_another_corpus_is_not_rebuilt_in_place(tmp_path, raw_text):
    """Rebuilt silently, a folder's manifest, BPE codes and dictionary were replaced under the
    runs trained on them (another ``[corpus] raw`` pointed at it, or its raw test file edited)."""
    from mlmha_fairseq.corpus.raw_text import build_raw_text_corpus

    built = tmp_path / "built"
    edited = tmp_path / "edited"
    shutil.copytree(raw_text, edited)
    build_raw_text_corpus(str(edited), ["fr"], "en", str(built), BPE_MERGES)
    manifest = (built / "manifest.json").read_bytes()
    with open(edited / "test.en", "a", encoding="utf-8") as test:
        test.write("one more reference\n")
    with open(edited / "test.fr", "a", encoding="utf-8") as test:
        test.write("une phrase de plus\n")
    with pytest.raises(UsageError) as refused:
        build_raw_text_corpus(str(edited), ["fr"], "en", str(built), BPE_MERGES)
    assert str(refused.value).startswith(f"corpus folder {built} holds a corpus built from other input or settings "
                                         "(test.en changed; test.fr changed)")
    with pytest.raises(UsageError, match=r"\(raw\.dir '.*edited' instead of '.*raw'\)"):
        build_raw_text_corpus(str(raw_text), ["fr"], "en", str(built), BPE_MERGES)
    assert (built / "manifest.json").read_bytes() == manifest  # nothing replaced
    rebuilt = build_raw_text_corpus(str(edited), ["fr"], "en", str(built), BPE_MERGES, rebuild=True)
    assert rebuilt["sizes"]["test"] == len((edited / "test.en").read_text().splitlines())
