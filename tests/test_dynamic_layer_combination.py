"""DLCL, the dynamic linear combination of layers (Wang et al. 2019), as a module and inside the
slot Transformer; its equations inside a whole model are in tests/test_equations.py."""
import argparse

import pytest
import torch
from fairseq.models import ARCH_CONFIG_REGISTRY

from fairseq_helpers import NORMS, PRE_NORM, assert_incremental_matches_full, build_model, random_batch
from mlmha_fairseq.models.joint_attention import DLCLEncoderLayerInputs
from mlmha_fairseq.modules.dynamic_layer_combination import DynamicLinearCombination

D, ENCODER_LAYERS = 16, 3  # tests/fairseq_helpers.TINY_MODEL_ARGS
LENGTH, BSZ = 5, 2


def num_params(module):
    return sum(p.numel() for p in module.parameters())


def added_parameters(num_layers, dim):
    """(L+1)(L+2)/2 scalars of the lower-triangular W (rows 1..L+1 over y_0..y_l) and L
    LayerNorms (gain and bias), pre- and post-norm alike."""
    return (num_layers + 1) * (num_layers + 2) // 2 + num_layers * 2 * dim


@pytest.mark.parametrize("normalize_before", [False, True])
def test_weights_start_as_the_average_of_the_layers_below(normalize_before):
    module = DynamicLinearCombination(ENCODER_LAYERS, D, normalize_before)
    rows = torch.arange(1, ENCODER_LAYERS + 2, dtype=torch.float)[:, None]
    expected = torch.ones(ENCODER_LAYERS + 1, ENCODER_LAYERS + 1).tril() / rows
    torch.testing.assert_close(module.matrix(), expected)
    # untrained, the post-norm input of layer 1 is y_0 itself (W_{1,0} = 1, no LayerNorm)
    y0 = torch.randn(LENGTH, BSZ, D)
    assert torch.equal(module.combine([module.store(0, y0)]), y0)


@pytest.mark.parametrize("normalize_before", [False, True])
def test_each_row_combines_every_layer_below_with_its_own_weights(normalize_before):
    torch.manual_seed(0)
    module = DynamicLinearCombination(ENCODER_LAYERS, D, normalize_before)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.add_(torch.randn_like(parameter))
    outputs = [torch.randn(LENGTH, BSZ, D) for _ in range(ENCODER_LAYERS + 1)]  # y_0..y_L
    history = [module.store(k, y) for k, y in enumerate(outputs)]
    norms = module.layer_norms
    matrix = module.matrix()
    for l in range(ENCODER_LAYERS + 1):  # x_{l+1}
        w = matrix[l]
        if normalize_before:  # pre-norm G, y_0 unnormalised
            expected = w[0] * outputs[0] + sum(w[k] * norms[k - 1](outputs[k]) for k in range(1, l + 1))
        else:  # post-norm G, no LayerNorm on the first row
            summed = sum(w[k] * outputs[k] for k in range(l + 1))
            expected = norms[l - 1](summed) if l > 0 else summed
        torch.testing.assert_close(module.combine(history[: l + 1]), expected)
    assert torch.count_nonzero(matrix.triu(1)) == 0


def test_rows_outside_the_stack_are_refused():
    module = DynamicLinearCombination(2, D, True)
    with pytest.raises(ValueError, match="combines 1..3 layer outputs, got 4"):
        module.combine([torch.zeros(LENGTH, BSZ, D)] * 4)
    with pytest.raises(ValueError, match="at least one layer"):
        DynamicLinearCombination(0, D, True)
    assert len(DynamicLinearCombination(1, D, True).weights) == 2  # a one-layer stack: two rows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_history_is_combined_in_its_own_precision(dtype):
    """Under fairseq's --amp the weights stay fp32 while the layer outputs are half precision:
    the (pre-norm) combination stays in the outputs' precision."""
    module = DynamicLinearCombination(2, D, normalize_before=True)
    history = [torch.randn(LENGTH, BSZ, D).to(dtype) for _ in range(2)]
    combined = module.combine(history)
    assert combined.dtype == dtype
    torch.testing.assert_close(combined, (history[0] + history[1]) / 2)


@NORMS
def test_parameter_count_is_the_triangular_matrix_and_one_layer_norm_per_layer(norm):
    baseline = num_params(build_model("transformer", *norm))
    model = build_model("slot_transformer", "--dlcl-encoder", *norm)
    assert num_params(model) - baseline == added_parameters(ENCODER_LAYERS, D) == 106
    assert isinstance(model.encoder.layer_inputs, DLCLEncoderLayerInputs)
    assert num_params(model.encoder.layer_inputs) == added_parameters(ENCODER_LAYERS, D)


def test_closed_form_at_the_wmt_preset_size():
    """``dlcl_transformer_wmt_en_de`` at its own sizes (d=512, 20 encoder layers): 231 weights
    and 20 LayerNorms more than the pre-norm base Transformer of the same depth."""
    with torch.device("meta"):
        module = DynamicLinearCombination(20, 512, True)
    assert num_params(module) == added_parameters(20, 512) == 231 + 20 * 1024


@NORMS
def test_incremental_decoding_matches_full_forward(norm):
    torch.manual_seed(0)
    model = build_model("slot_transformer", "--dlcl-encoder", *norm)
    assert_incremental_matches_full(model, model.decoder.dictionary)


def test_generation_reads_the_combination_not_the_top_layer():
    """fairseq-generate calls the encoder without ``return_all_hiddens``: the output is still
    the last row of W over every layer, and no states are returned."""
    torch.manual_seed(0)
    model = build_model("slot_transformer", "--dlcl-encoder", *PRE_NORM).eval()
    src, lengths, _ = random_batch(model.decoder.dictionary)
    with torch.no_grad():
        out = model.encoder.forward_torchscript({"src_tokens": src, "src_lengths": lengths})
        full = model.encoder(src, src_lengths=lengths, return_all_hiddens=True)
    assert out["encoder_states"] == [] and len(full["encoder_states"]) == ENCODER_LAYERS + 1
    combination = model.encoder.layer_inputs
    history = [combination.store(k, y) for k, y in enumerate(full["encoder_states"])]
    with torch.no_grad():
        expected = model.encoder.layer_norm(combination.combine(history))
    torch.testing.assert_close(out["encoder_out"][0], expected)
    assert not torch.allclose(out["encoder_out"][0], model.encoder.layer_norm(full["encoder_states"][-1]))


@pytest.mark.parametrize("options, given", [
    (["--layer-aggregation", "s-agg"], "--layer-aggregation s-agg"),
    (["--mlrf-encoder-fusion", "fnn"], "--mlrf-encoder-fusion fnn"),
])
def test_mechanisms_that_replace_the_encoder_output_are_refused(options, given):
    with pytest.raises(ValueError, match=rf"^the encoder output 'encoder_out' is written by several mechanisms "
                                         rf"\({given}, --dlcl-encoder\): choose one$"):
        build_model("slot_transformer", "--dlcl-encoder", *options)


def test_mlmha_reads_the_combined_encoder_output_as_its_top_tap():
    """MLMHA writes its own entry, so it composes with DLCL: its top tap is the encoder output."""
    model = build_model("slot_transformer", "--dlcl-encoder", "--decoder-cross-attention", "multi-layer").eval()
    src, lengths, prev = random_batch(model.decoder.dictionary)
    with torch.no_grad():
        out = model.encoder(src, src_lengths=lengths)
        assert torch.equal(out["mlmha_taps"][0][-1], out["encoder_out"][0])
        assert torch.isfinite(model(src, lengths, prev)[0]).all()


def test_off_by_default_and_the_encoder_is_fairseqs():
    model = build_model("slot_transformer")
    assert model.args.dlcl_encoder is False and model.encoder.layer_inputs is None


@pytest.mark.parametrize("arch, encoder_layers, embed_dim", [
    ("dlcl_transformer_wmt_en_de", 20, 512), ("dlcl_transformer_iwslt", 8, 256)])
def test_presets_are_pre_norm_dlcl_with_a_deeper_encoder(arch, encoder_layers, embed_dim):
    args = argparse.Namespace()
    ARCH_CONFIG_REGISTRY[arch](args)
    assert args.dlcl_encoder is True
    assert args.encoder_normalize_before is True and args.decoder_normalize_before is True
    assert (args.encoder_layers, args.encoder_embed_dim) == (encoder_layers, embed_dim)
    assert args.decoder_layers < args.encoder_layers
    model = build_model(arch)  # at the tiny test sizes
    assert model.encoder.layer_inputs.normalize_before
