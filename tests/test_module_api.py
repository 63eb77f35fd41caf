"""The mechanism modules used on their own (as a user composing them outside the package's
models would): their defaults and their errors. These pin behaviour the model-level tests
cannot see, because the models always pass every argument."""
import pytest
import torch
import torch.nn.functional as F
from fairseq.models import BaseFairseqModel

from mlmha_fairseq.modules.auxiliary_information_fusion import AuxiliaryInformationFusion
from mlmha_fairseq.modules.dual_contextual import DualContextual, LocalContextualUnit
from mlmha_fairseq.modules.layer_aggregation import Aggregate
from mlmha_fairseq.modules.multi_layer_attention import MultiLayerMultiheadAttention
from mlmha_fairseq.modules.representation_fusion import FeedForward


def test_aif_default_has_no_dropout_on_the_fused_vector():
    """Thesis §4.2 mentions no dropout around the fusion: by default ``z^f = [f^1; ...] W``
    exactly, also in training mode."""
    fusion = AuxiliaryInformationFusion(embed_dim=8, num_aux=2).train()
    features = torch.randn(3, 2, 16)
    torch.testing.assert_close(fusion(features), features @ fusion.proj.weight.t())


def test_aif_needs_an_auxiliary_decoder():
    with pytest.raises(ValueError, match="AIF needs at least one auxiliary decoder, got 0"):
        AuxiliaryInformationFusion(embed_dim=8, num_aux=0)


def global_attention_probabilities(module, r):
    """softmax(Q K^T / sqrt(d_k)) of the self-attention FI unit h_g = FI(r, r) (thesis
    Eq. 5.6), per head: B x H x T x T; ``r``: T x B x C."""
    unit = module.global_interaction
    bsz, heads = r.size(1), module.num_heads
    x = r.transpose(0, 1)  # B x T x C
    q = (x @ unit.q_proj.weight.t()).view(bsz, -1, heads, module.head_dim).transpose(1, 2)
    k = (x @ unit.k_proj.weight.t()).view(bsz, -1, heads, module.head_dim).transpose(1, 2)
    return torch.softmax(q @ k.transpose(-1, -2) / module.head_dim ** 0.5, dim=-1)


def test_dual_contextual_returns_the_global_unit_attention_only_when_asked():
    """Called as fairseq calls a self-attention: no weights unless ``need_weights``; then the
    weights of h_g = FI(r, r), averaged over heads (fairseq's format) or per head."""
    torch.manual_seed(0)
    module = DualContextual(embed_dim=8, num_heads=2, kernel_size=2, causal=False).eval()
    r = torch.randn(5, 3, 8)
    assert module(r, r, r)[1] is None
    assert module(r, r, r, need_weights=False)[1] is None
    expected = global_attention_probabilities(module, r)
    torch.testing.assert_close(module(r, r, r, need_weights=True)[1], expected.mean(dim=1))
    torch.testing.assert_close(module(r, r, r, need_weights=True, need_head_weights=True)[1],
                               expected.transpose(0, 1))


def test_dual_contextual_exposes_the_self_attention_cache_to_fairseqs_decoder_layer():
    """fairseq's decoder layer reads ``self_attn._get_input_buffer(state)["prev_key"]``: the
    keys of the self-attention unit so far, B x H x T x d_k."""
    module = DualContextual(embed_dim=8, num_heads=2, kernel_size=3, causal=True).eval()
    state = {}
    for step in range(3):
        r = torch.randn(1, 4, 8)
        module(r, r, r, incremental_state=state)
        assert module._get_input_buffer(state)["prev_key"].shape == (4, 2, step + 1, 4)


def dual_contextual(**options):
    torch.manual_seed(0)
    return DualContextual(embed_dim=8, num_heads=2, kernel_size=3, causal=False, **options)


def test_dual_contextual_and_its_local_unit_default_to_no_dropout():
    r = torch.randn(5, 3, 8)
    module = dual_contextual()
    torch.testing.assert_close(module.train()(r, r, r)[0], module.eval()(r, r, r)[0])
    local = LocalContextualUnit(embed_dim=8, kernel_size=2, causal=False)
    torch.testing.assert_close(local.train()(r), local.eval()(r))


def test_dual_contextual_dropout_applies_to_the_local_units_r_hat():
    """``dropout`` = 1 drops all of ``r_hat`` in training (thesis Eq. 5.4 with dropout before
    the residual): ``l_c = LN(r)``, as with a convolution that outputs zeros."""
    r = torch.randn(5, 3, 8)
    dropped = dual_contextual(dropout=1.0).train()
    silent = dual_contextual().eval()
    with torch.no_grad():
        silent.local_unit.conv.weight.zero_()
        silent.local_unit.conv.bias.zero_()
    torch.testing.assert_close(dropped(r, r, r)[0], silent(r, r, r)[0])


def test_dual_contextual_attention_dropout_applies_to_both_interaction_units():
    """``attention_dropout`` = 1 drops every attention weight of h_l and h_g in training,
    leaving ``z_hat = b_z``."""
    r = torch.randn(5, 3, 8)
    module = dual_contextual(attention_dropout=1.0).train()
    with torch.no_grad():
        module.merge_bias.copy_(torch.arange(8.0))
    torch.testing.assert_close(module(r, r, r)[0], torch.arange(8.0).expand(5, 3, 8))


class Holder(BaseFairseqModel):
    """A fairseq model holding one module, so that fairseq's own ``make_generation_fast_``
    (what ``fairseq-generate --retain-dropout --retain-dropout-modules`` calls) walks it."""

    def __init__(self, module):
        super().__init__()
        self.module = module


def layer_norm(x):
    return F.layer_norm(x, x.shape[-1:])


def aggregate_inputs():
    return torch.randn(2, 5, 3, 8, dtype=torch.float64)


def aif_fully_dropped():
    """AIF (thesis Eq. 4.2) with dropout 1 on z^f: zeros."""
    module = AuxiliaryInformationFusion(embed_dim=8, num_aux=2, dropout=1.0).double()
    features = torch.randn(5, 3, 16, dtype=torch.float64)
    return module, lambda: module(features), torch.zeros(5, 3, 8, dtype=torch.float64)


def local_unit_fully_dropped():
    """DC local unit (thesis Eq. 5.4) with r_hat dropped: l_c = LN(r)."""
    module = LocalContextualUnit(embed_dim=8, kernel_size=3, causal=False, dropout=1.0).double()
    r = torch.randn(5, 3, 8, dtype=torch.float64)
    return module, lambda: module(r), layer_norm(r)


def aggregate_output_dropped():
    """AGG unit (thesis Eq. 3.3) with the FFN output dropped: LN(sum_i r_i)."""
    module = Aggregate(2, 8, 12, dropout=1.0, activation_dropout=0.0).double()
    inputs = aggregate_inputs()
    return module, lambda: module(inputs), layer_norm(inputs.sum(dim=0))


def aggregate_activation_dropped():
    """AGG unit with the FFN's hidden activation dropped: LN(b_2 + sum_i r_i)."""
    module = Aggregate(2, 8, 12, dropout=0.0, activation_dropout=1.0).double()
    inputs = aggregate_inputs()
    expected = layer_norm(module.fc2.bias.detach() + inputs.sum(dim=0))
    return module, lambda: module(inputs), expected


def mlrf_hidden_dropped():
    """MLRF's FNN (Wang et al. 2018, §4.2) with its hidden layer dropped: ``W_b 0 + b_b``."""
    module = FeedForward(8, 12, 4, "relu", dropout=1.0).double()
    x = torch.randn(5, 3, 8, dtype=torch.float64)
    return module, lambda: module(x), module.fc2.bias.detach().expand(5, 3, 4)


def mlmha_attention_dropped():
    """MLMHA (Eqs. 8-12) with every attention weight dropped: contexts 0, out_proj has no
    bias, so the output is 0."""
    module = MultiLayerMultiheadAttention(8, 2, num_taps=2, joint_weights=True,
                                          concat_contexts=False, dropout=1.0).double()
    query = torch.randn(4, 3, 8, dtype=torch.float64)
    taps = torch.randn(2, 5, 3, 8, dtype=torch.float64)
    return module, lambda: module(query, taps, taps)[0], torch.zeros(4, 3, 8, dtype=torch.float64)


@pytest.mark.parametrize("case, name", [
    (aif_fully_dropped, "AuxiliaryInformationFusion"),
    (local_unit_fully_dropped, "LocalContextualUnit"),
    (aggregate_output_dropped, "Aggregate"),
    (aggregate_activation_dropped, "Aggregate"),
    (mlmha_attention_dropped, "MultiLayerMultiheadAttention"),
    (mlrf_hidden_dropped, "FeedForward"),
])
def test_dropout_is_retained_at_inference_for_the_modules_named_by_class(case, name):
    """``--retain-dropout-modules`` names modules by class: listing the module's class keeps
    its dropout at inference (dropout 1 gives the closed form written in each case); listing
    another class leaves it off (the output of the same module in eval mode)."""
    torch.manual_seed(0)
    module, run, dropped = case()
    module.eval()
    with torch.no_grad():
        undropped = run()
    assert not torch.allclose(undropped, dropped)
    Holder(module).make_generation_fast_(retain_dropout=True, retain_dropout_modules=["Other"])
    with torch.no_grad():
        torch.testing.assert_close(run(), undropped)
    Holder(module).make_generation_fast_(retain_dropout=True, retain_dropout_modules=[name])
    with torch.no_grad():
        torch.testing.assert_close(run(), dropped)


def test_mlmha_defaults_bias_free_unshared_projections_and_no_dropout():
    """MLMHA built from its required arguments only (M-01 here): bias-free, one query, key and
    value projection per tap (Ampomah et al. 2020, Eqs. 7-8: ``W^{q,(i)}``, ``W^{k,(i)}``,
    ``W^{v,(i)}``, n d x d matrices each) and one d x d output projection for the summed
    context, so 3 n d^2 + d^2 parameters; no dropout (training output = eval output); and
    the decoder hands it fairseq's ``encoder_out`` as its memory; it returns attention weights
    only when asked (``need_weights``/``need_head_weights``, as called by fairseq's decoder
    layer)."""
    torch.manual_seed(0)
    taps, dim = 3, 8
    module = MultiLayerMultiheadAttention(dim, 2, num_taps=taps, joint_weights=True,
                                          concat_contexts=False)
    assert sum(p.numel() for p in module.parameters()) == 3 * taps * dim * dim + dim * dim
    assert module.memory_key == "encoder_out"
    query = torch.randn(4, 3, dim)
    memory = torch.randn(taps, 5, 3, dim)
    output, weights = module.train()(query, memory, memory)
    assert weights is None
    torch.testing.assert_close(output, module.eval()(query, memory, memory)[0])
