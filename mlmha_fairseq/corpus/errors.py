"""The one exception type of the corpus builder."""


class CorpusError(RuntimeError):
    """A user-facing error (bad input, missing database, no network); the CLI prints it, exits 1."""
