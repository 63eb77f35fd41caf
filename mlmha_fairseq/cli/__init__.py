"""Command-line entry points (``python -m mlmha_fairseq.cli.<name> --help``)."""
