"""Train/valid/test splits by book, and the training-only length filter and subsampling.

Whole books go to test and valid, so no verse of a test book is ever seen in training;
the length filter and the subsampling touch the training split only.
"""
import random
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from mlmha_fairseq.corpus.bible import Verse
from mlmha_fairseq.corpus.errors import CorpusError
from mlmha_fairseq.corpus.versions import book_name, resolve_book

TRAIN, VALID, TEST = "train", "valid", "test"
SPLITS = (TRAIN, VALID, TEST)

# Defaults: short, self-contained books, one Old and one New Testament book per side, so a
# demo decodes its test set in seconds (Ruth 85, Jonah 48, 1 John 105 verses; Obadiah 21,
# Philippians 104 verses).
DEFAULT_TEST_BOOKS = ("Ruth", "Jonah", "1John")
DEFAULT_VALID_BOOKS = ("Obadiah", "Philippians")


def resolve_books(test_books: Sequence[str], valid_books: Sequence[str]) -> Dict[str, List[int]]:
    """Book numbers of the test and valid splits; they must not share a book."""
    held_out = {TEST: sorted({resolve_book(b) for b in test_books}),
                VALID: sorted({resolve_book(b) for b in valid_books})}
    overlap = set(held_out[TEST]) & set(held_out[VALID])
    if overlap:
        names = ", ".join(book_name(b) for b in sorted(overlap))
        raise CorpusError(f"--test-books and --valid-books overlap ({names}): "
                          "a book belongs to one split only")
    if not held_out[TEST] or not held_out[VALID]:
        raise CorpusError("--test-books and --valid-books need at least one book each")
    return held_out


def split_by_book(verses: Sequence[Verse],
                  held_out: Dict[str, List[int]]) -> Dict[str, List[Verse]]:
    """Put each verse in the split of its book: test, valid, or train for every other book."""
    split_of_book = {book: split for split, books in held_out.items() for book in books}
    splits: Dict[str, List[Verse]] = {split: [] for split in SPLITS}
    for verse in verses:
        splits[split_of_book.get(verse.book, TRAIN)].append(verse)
    for split in SPLITS:
        if not splits[split]:
            books = ", ".join(book_name(b) for b in held_out.get(split, []))
            where = f" (books: {books})" if books else ""
            raise CorpusError(f"the {split} split is empty{where}: choose books that the "
                              "database has")
    return splits


def select_training(candidates: int, fits: Callable[[int], bool], max_verses: Optional[int],
                    seed: int) -> Tuple[List[int], int]:
    """Indices of the training tuples to keep, in their original order, and how many were too long.

    The ``candidates`` tuples are visited in a random order fixed by ``seed``; each one for which
    ``fits(index)`` holds is kept, until ``max_verses`` are kept (all of them if ``None``). The
    result is a deterministic uniform sample of the tuples that fit, and tuples after the last
    one needed are never examined (so ``fits`` may do expensive work such as tokenizing).
    """
    order = list(range(candidates))
    random.Random(seed).shuffle(order)
    kept, too_long = [], 0
    for index in order:
        if max_verses is not None and len(kept) == max_verses:
            break
        if fits(index):
            kept.append(index)
        else:
            too_long += 1
    return sorted(kept), too_long
