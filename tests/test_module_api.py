"""The mechanism modules used on their own (as a user composing them outside the package's
models would): their defaults and their errors. These pin behaviour the model-level tests
cannot see, because the models always pass every argument."""
import pytest
import torch

from mlmha_fairseq.modules.auxiliary_information_fusion import AuxiliaryInformationFusion


def test_aif_default_has_no_dropout_on_the_fused_vector():
    """Thesis §4 mentions no dropout around the fusion: by default ``z^f = [f^1; ...] W``
    exactly, also in training mode."""
    fusion = AuxiliaryInformationFusion(embed_dim=8, num_aux=2).train()
    features = torch.randn(3, 2, 16)
    torch.testing.assert_close(fusion(features), features @ fusion.proj.weight.t())


def test_aif_needs_an_auxiliary_decoder():
    with pytest.raises(ValueError, match="AIF needs at least one auxiliary decoder, got 0"):
        AuxiliaryInformationFusion(embed_dim=8, num_aux=0)
