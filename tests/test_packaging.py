"""The version has one source, ``mlmha_fairseq.__version__``: the installed distribution's
metadata (built from pyproject.toml) and CITATION.cff say the same."""
import importlib.metadata
import pathlib

import yaml

import mlmha_fairseq

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_installed_distribution_has_the_packages_version():
    """An install older than the source (``pip install -e .`` not run again after a version
    change) fails here too: the metadata is written at install time."""
    assert importlib.metadata.version("mlmha_fairseq") == mlmha_fairseq.__version__


def test_citation_file_cites_this_version():
    citation = yaml.safe_load((ROOT / "CITATION.cff").read_text(encoding="utf-8"))
    assert citation["cff-version"] == "1.2.0"
    assert str(citation["version"]) == mlmha_fairseq.__version__
