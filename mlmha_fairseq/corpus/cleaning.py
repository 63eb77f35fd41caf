"""Clean verse texts and drop tuples that are not real translations.

Markup found in the database (see ``docs/corpus.md``) and what happens to it:

* ``[word]`` words supplied by the translators (WEB, Darby, Elberfelder, Segond): brackets
  removed, words kept;
* ``#Dieu`` (Darby marks the Hebrew *El*): ``#`` removed;
* ``***`` / ``* * *`` lacunae of BBE and Elberfelder's end-of-book marks: removed;
* ``(32:1)`` alternative (Hebrew) verse numbers inside the text (Segond, Ostervald,
  Schlachter): removed;
* the backtick WEB uses as an apostrophe/inner quote: replaced by ``'``;
* U+00AD (soft hyphen), which Reina-Valera 1909 has instead of ``¡``: restored to ``¡`` in
  Spanish, removed elsewhere; runs of whitespace (tabs, newlines) become one space.

A tuple is dropped when any of its verses is *empty* after cleaning or a placeholder
(``[]``, ``(*)``, ``***``, WEB's "dummy verses inserted by amos"), or *untranslated*: it
was filled in from the KJV (``(MISSING) [KJV: ...]``, ``(ADDED FROM KJV: ...)``), or its text
is identical to the text of another language in the tuple (mostly lists of proper names).
"""
import collections
import re
import unicodedata
from typing import Counter, List, Sequence, Tuple

from mlmha_fairseq.corpus.bible import Verse

EMPTY = "empty"
UNTRANSLATED = "untranslated"

_SOFT_HYPHEN = "\u00ad"
_SOFT_HYPHEN_MEANS = {"es": "\u00a1"}  # "¡"
_BACKTICK_AS = "'"
_VERSIFICATION_NOTE = re.compile(r"\(\d+:\d+\)")
_MARKUP_CHARS = re.compile(r"[\[\]#*]")
_WHITESPACE = re.compile(r"\s+")
_PLACEHOLDER = re.compile(r"^(\W*|dummy verses? inserted\b.*)$", re.IGNORECASE)
_FILLED_FROM_KJV = re.compile(r"\bKJV\b")


def clean_text(text: str, language: str) -> str:
    """Remove the database's markup from one verse (see the module docstring)."""
    text = unicodedata.normalize("NFC", text)
    text = text.replace(_SOFT_HYPHEN, _SOFT_HYPHEN_MEANS.get(language, ""))
    text = text.replace("`", _BACKTICK_AS)
    text = _VERSIFICATION_NOTE.sub(" ", text)
    text = _MARKUP_CHARS.sub("", text)
    return _WHITESPACE.sub(" ", text).strip()


def drop_reason(texts: Sequence[str], languages: Sequence[str]) -> str:
    """Why a tuple of cleaned texts is dropped: ``EMPTY``, ``UNTRANSLATED``, or ``""`` (kept)."""
    if any(_PLACEHOLDER.match(text) for text in texts):
        return EMPTY
    if any(_FILLED_FROM_KJV.search(text) for text in texts):
        return UNTRANSLATED
    for i, (text_i, lang_i) in enumerate(zip(texts, languages)):
        for text_j, lang_j in zip(texts[i + 1:], languages[i + 1:]):
            if lang_i != lang_j and text_i.casefold() == text_j.casefold():
                return UNTRANSLATED
    return ""


def clean_verses(verses: Sequence[Verse], languages: Sequence[str]) -> Tuple[List[Verse], Counter]:
    """Clean every text of every tuple and drop the tuples :func:`drop_reason` rejects.

    ``languages`` gives the language of each position of the tuples. Returns the kept verses
    and a counter of dropped tuples by reason.
    """
    kept, dropped = [], collections.Counter()
    for verse in verses:
        texts = tuple(clean_text(text, lang) for text, lang in zip(verse.texts, languages))
        reason = drop_reason(texts, languages)
        if reason:
            dropped[reason] += 1
        else:
            kept.append(Verse(verse.key, texts))
    return kept, dropped
