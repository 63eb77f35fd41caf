import pytest
import torch

# Tiny models gain nothing from intra-op threads; on a shared CPU they make generation
# tens of times slower through oversubscription.
torch.set_num_threads(1)

from fairseq_helpers import preprocess, write_reversal_corpus


@pytest.fixture(scope="session")
def data_bin(tmp_path_factory):
    """The toy reversal corpus, binarized by fairseq-preprocess (joined dictionary)."""
    root = tmp_path_factory.mktemp("corpus")
    write_reversal_corpus(root)
    preprocess(root, root / "bin")
    return root / "bin"
