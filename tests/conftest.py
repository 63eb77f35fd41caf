import os

import pytest
import torch

# Tiny models gain nothing from intra-op threads; on a shared CPU they make generation
# tens of times slower through oversubscription.
torch.set_num_threads(1)

from fairseq_helpers import preprocess, write_reversal_corpus

# Fixtures that binarize a corpus for fairseq's command-line tools.
CLI_FIXTURES = {"data_bin", "n_way_bin"}


# the exhaustive sweeps (minutes), beyond the sample that CI runs: `make exhaustive` runs them all,
# `make security` the checkpoint-payload one (tests/test_checkpoint_payloads.py; the suite covers
# the same channel on one model, test_checkpoint_safety.py)
EXHAUSTIVE = os.environ.get("MLMHA_EXHAUSTIVE") == "1"


def pytest_collection_modifyitems(items):
    """Tests that run fairseq's command-line tools on a binarized corpus get the ``cli``
    marker, so ``pytest -m "not cli"`` skips them (test tiers: docs/testing.md); the
    ``exhaustive`` ones are skipped unless MLMHA_EXHAUSTIVE=1 (``make exhaustive``)."""
    skip = pytest.mark.skip(reason="exhaustive sweep: make exhaustive (MLMHA_EXHAUSTIVE=1)")
    for item in items:
        if CLI_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.cli)
        if "exhaustive" in item.keywords and not EXHAUSTIVE:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def data_bin(tmp_path_factory):
    """The toy reversal corpus, binarized by fairseq-preprocess (joined dictionary)."""
    root = tmp_path_factory.mktemp("corpus")
    write_reversal_corpus(root)
    preprocess(root, root / "bin")
    return root / "bin"


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """The tiny Bible's French -> English corpus (build_corpus's layout), for the experiment
    runner. Built once, before any test reads the runner's log (the corpus builder reconfigures
    logging)."""
    from test_demo import tiny_corpus

    return tiny_corpus(tmp_path_factory.mktemp("tiny"), "fr")
