import pytest

from fairseq_helpers import preprocess, write_reversal_corpus


@pytest.fixture(scope="session")
def data_bin(tmp_path_factory):
    """The toy reversal corpus, binarized by fairseq-preprocess (joined dictionary)."""
    root = tmp_path_factory.mktemp("corpus")
    write_reversal_corpus(root)
    preprocess(root, root / "bin")
    return root / "bin"
