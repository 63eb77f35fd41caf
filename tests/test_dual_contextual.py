"""The Dual Contextual module in the slot Transformer (issue 9, thesis ch. 5)."""
import argparse
import json
import math
import subprocess
import sys

import pytest
import torch

from fairseq_helpers import (
    PRE_NORM,
    assert_beam_search_scores_match_full,
    assert_incremental_matches_full,
    assert_round_trip,
    build_model,
    random_batch,
    toy_dictionary,
)
from mlmha_fairseq.evaluation.attention_statistics import encoder_attention_statistics
from mlmha_fairseq.evaluation.fi_diversity import fi_diversity, js_divergence, reduce_heads
from mlmha_fairseq.models.dual_contextual import DUAL_CONTEXTUAL_MODULE
from mlmha_fairseq.models.layer_selection import parse_layers
from mlmha_fairseq.modules.dual_contextual import DualContextual, LocalContextualUnit

D, ENCODER_LAYERS, DECODER_LAYERS = 16, 3, 2  # tests/fairseq_helpers.TINY_MODEL_ARGS
FULL_DC = ["--dc-encoder-layers", "all", "--dc-decoder-layers", "all"]


def num_params(module):
    return sum(p.numel() for p in module.parameters())


def dc_layers(stack):
    return [i for i, layer in enumerate(stack.layers) if isinstance(layer.self_attn, DualContextual)]


def dc_closed_form(d, f):
    """Thesis §5.3: conv f*2d^2 + 2d, local LN 2d, two bias-free FIs 6d^2, W_z 2d^2 and b_z d."""
    return 2 * f * d * d + 2 * d + 2 * d + 6 * d * d + 2 * d * d + d


# --- window, padding, causality -------------------------------------------------------------

@pytest.mark.parametrize(
    "kernel_size, causal, window",
    [(1, False, [0]), (2, False, [0, 1]), (3, False, [-1, 0, 1]), (4, False, [-1, 0, 1, 2]),
     (2, True, [-1, 0]), (3, True, [-2, -1, 0])],
)
def test_local_unit_sees_exactly_its_window(kernel_size, causal, window):
    """Encoder: centred window, the extra input of an even f on the right; decoder: causal."""
    unit = LocalContextualUnit(D, kernel_size, causal).eval()
    r = torch.randn(9, 1, D, requires_grad=True)
    t = 4
    (unit(r)[t] * torch.randn(1, D)).sum().backward()  # a plain sum of a LayerNorm output is constant
    seen = r.grad[:, 0].abs().sum(dim=-1).nonzero().flatten() - t
    assert seen.tolist() == window


@pytest.mark.parametrize("left_pad", [True, False], ids=["left-pad", "right-pad"])
@pytest.mark.parametrize("norm", [[], PRE_NORM], ids=["post-norm", "pre-norm"])
@pytest.mark.parametrize("kernel_size", ["2", "3"])
def test_padding_does_not_change_real_positions(left_pad, norm, kernel_size):
    """Each sentence encoded alone equals its rows in a batch padded on either side."""
    dictionary = toy_dictionary()
    model = build_model("slot_transformer", "--dc-encoder-layers", "all", "--dc-kernel-size",
                        kernel_size, *norm, dictionary=dictionary).eval()
    src, lengths, _ = random_batch(dictionary, batch_size=4, src_len=8, left_pad=left_pad)
    with torch.no_grad():
        batched = model.encoder(src, src_lengths=lengths)["encoder_out"][0]
        for row, length in enumerate(lengths.tolist()):
            real = slice(8 - length, 8) if left_pad else slice(0, length)
            alone = model.encoder(src[row : row + 1, real], src_lengths=lengths[row : row + 1])
            torch.testing.assert_close(batched[real, row], alone["encoder_out"][0][:, 0])


@pytest.mark.parametrize("left_pad", [True, False], ids=["left-pad", "right-pad"])
@pytest.mark.parametrize("norm", [[], PRE_NORM], ids=["post-norm", "pre-norm"])
def test_logits_of_a_sentence_do_not_depend_on_the_batch_it_is_padded_in(left_pad, norm):
    """Full-DC's logits (encoder and causal decoder DC modules) for each sentence alone equal
    its rows in a batch of sources of 1 to 8 tokens, padded on either side."""
    dictionary = toy_dictionary()
    model = build_model("slot_transformer", *FULL_DC, *norm, dictionary=dictionary).eval()
    lengths = torch.tensor([8, 1, 5, 3])
    src = torch.full((4, 8), dictionary.pad())
    for row, length in enumerate(lengths.tolist()):
        words = torch.randint(dictionary.nspecial, len(dictionary), (length,), generator=torch.Generator().manual_seed(row))
        words[-1] = dictionary.eos()
        if left_pad:
            src[row, 8 - length:] = words
        else:
            src[row, :length] = words
    _, _, prev = random_batch(dictionary, batch_size=4, tgt_len=6)
    with torch.no_grad():
        batched = model(src, lengths, prev)[0]
        for row, length in enumerate(lengths.tolist()):
            real = slice(8 - length, 8) if left_pad else slice(0, length)
            alone = model(src[row : row + 1, real], lengths[row : row + 1], prev[row : row + 1])[0]
            torch.testing.assert_close(batched[row], alone[0])


def test_pad_rows_are_zeroed_before_the_convolution():
    """Whatever the pad rows of r hold, the real rows of l_c are the same."""
    unit = LocalContextualUnit(D, 3, causal=False).eval()
    r = torch.randn(6, 2, D)
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[0, :2] = pad[1, 4:] = True
    noisy = r.masked_fill(pad.t().unsqueeze(-1), 0.0) + 5 * torch.randn(6, 2, D) * pad.t().unsqueeze(-1)
    local, local_noisy = unit(r, pad), unit(noisy, pad)
    torch.testing.assert_close(local[~pad.t()], local_noisy[~pad.t()])
    assert local[pad.t()].abs().sum() == 0


@pytest.mark.parametrize("norm", [[], PRE_NORM], ids=["post-norm", "pre-norm"])
def test_decoder_is_causal(norm):
    """Changing the target token at step t changes no output before t."""
    dictionary = toy_dictionary()
    model = build_model("slot_transformer", "--dc-decoder-layers", "all", "--dc-kernel-size", "3",
                        *norm, dictionary=dictionary).eval()
    src, lengths, prev = random_batch(dictionary)
    changed, t = prev.clone(), 3
    words = len(dictionary) - dictionary.nspecial
    changed[:, t] = dictionary.nspecial + (prev[:, t] - dictionary.nspecial + 1) % words  # another word
    with torch.no_grad():
        out = model(src, lengths, prev)[0]
        out_changed = model(src, lengths, changed)[0]
    torch.testing.assert_close(out[:, :t], out_changed[:, :t])
    assert not torch.allclose(out[:, t:], out_changed[:, t:])


@pytest.mark.parametrize(
    "options",
    [["--dc-decoder-layers", "all"], FULL_DC + PRE_NORM,
     ["--dc-decoder-layers", "2", "--dc-kernel-size", "3"],
     ["--dc-decoder-layers", "all", "--dc-kernel-size", "1"]],
    ids=["dec-dc", "full-dc-pre-norm", "layer-2-f3", "f1"],
)
def test_incremental_decoding_equals_full_forward_with_beam_reordering(options):
    dictionary = toy_dictionary()
    model = build_model("slot_transformer", *options, dictionary=dictionary)
    assert_incremental_matches_full(model, dictionary)


@pytest.mark.parametrize("kernel_size", ["2", "3"])
def test_beam_search_scores_of_the_causal_module_match_the_full_forward(kernel_size, monkeypatch):
    """The local unit's window of the last f-1 inputs follows its hypothesis through beam
    search (hypotheses moving, sentences finishing)."""
    torch.manual_seed(0)
    dictionary = toy_dictionary()
    model = build_model("slot_transformer", *FULL_DC, "--dc-kernel-size", kernel_size, dictionary=dictionary)
    assert_beam_search_scores_match_full(model, dictionary, monkeypatch)


# --- parameters, layers and presets ---------------------------------------------------------

def test_parameter_count_per_layer_matches_the_thesis_closed_form():
    """d=512, 8 heads, f=2, bias-free FIs: 2,099,712 more than a bias-free self-attention."""
    d = 512
    assert num_params(DualContextual(d, 8, 2, causal=False)) - 4 * d * d == 2_099_712
    assert dc_closed_form(d, 2) - 4 * d * d == 2_099_712


@pytest.mark.parametrize("norm", [[], PRE_NORM], ids=["post-norm", "pre-norm"])
@pytest.mark.parametrize("kernel_size", [1, 2, 3])
def test_model_parameters_match_the_closed_form(kernel_size, norm):
    """Each DC layer replaces fairseq's self-attention (4d^2 + 4d with biases); the
    pre-norm variant adds nothing."""
    baseline = num_params(build_model("transformer", *norm))
    model = build_model("slot_transformer", "--dc-encoder-layers", "1,3", "--dc-decoder-layers",
                        "2", "--dc-kernel-size", kernel_size, *norm)
    per_layer = dc_closed_form(D, kernel_size) - (4 * D * D + 4 * D)
    assert num_params(model) - baseline == 3 * per_layer


def test_paper_size_enc_dc_adds_the_theses_parameters():
    """dc_transformer_wmt_en_de (Table 5.2: +12.7M): 6 x 2,099,712 over a bias-free
    baseline, i.e. minus fairseq's 6 x 4d self-attention biases."""
    dictionary = toy_dictionary([f"w{i}" for i in range(1000)])
    paper_size = ["--encoder-layers", "6", "--decoder-layers", "6", "--encoder-embed-dim", "512",
                  "--decoder-embed-dim", "512", "--encoder-ffn-embed-dim", "2048",
                  "--decoder-ffn-embed-dim", "2048", "--encoder-attention-heads", "8",
                  "--decoder-attention-heads", "8", "--share-all-embeddings"]
    baseline = num_params(build_model("transformer_wmt_en_de", *paper_size, dictionary=dictionary))
    model = build_model("dc_transformer_wmt_en_de", *paper_size, dictionary=dictionary)
    assert num_params(model) - baseline == 6 * (2_099_712 - 4 * 512)


@pytest.mark.parametrize(
    "value, expected",
    [("none", []), ("all", [0, 1, 2, 3, 4, 5]), ("1-3", [0, 1, 2]), ("5-6", [4, 5]),
     ("1,3,5-6", [0, 2, 4, 5]), ("2", [1]), ("1-1", [0]), ("ALL", [0, 1, 2, 3, 4, 5])],
)
def test_layer_ranges(value, expected):
    assert sorted(parse_layers(value, 6, "--dc-encoder-layers", "encoder")) == expected


@pytest.mark.parametrize(
    "options, message",
    [(["--dc-encoder-layers", "2-4"], r"--dc-encoder-layers '2-4': 2-4 is not a range of encoder layers within 1\.\.3"),
     (["--dc-decoder-layers", "3"], r"--dc-decoder-layers '3': 3 is not a range of decoder layers within 1\.\.2"),
     (["--dc-encoder-layers", "0"], "--dc-encoder-layers '0'"),
     (["--dc-encoder-layers", "3-1"], "--dc-encoder-layers '3-1'"),
     (["--dc-encoder-layers", "first"], "expected none, all, or 1-based layers"),
     (["--dc-encoder-layers", "all", "--dc-kernel-size", "0"], "--dc-kernel-size 0"),
     (["--dc-decoder-layers", "all", "--cross-self-attention"], "--cross-self-attention")],
)
def test_bad_configurations_are_refused_with_a_clear_message(options, message):
    with pytest.raises(ValueError, match=message):
        build_model("slot_transformer", *options)


@pytest.mark.parametrize(
    "args, on",
    [({}, False),
     ({"dc_encoder_layers": "all"}, True),  # a preset's args, without the decoder's option
     ({"dc_decoder_layers": " 1-2 "}, True),
     ({"dc_encoder_layers": None, "dc_decoder_layers": " NONE "}, False),
     ({"dc_encoder_layers": "none", "dc_decoder_layers": "2"}, True)],
    ids=["no options", "encoder only", "decoder only", "none", "decoder on"],
)
def test_module_is_on_when_either_layer_option_names_layers(args, on):
    """The switch of the set-while-off check (--dc-kernel-size needs it): a missing or None
    layer option reads as none, in any case and spacing."""
    assert DUAL_CONTEXTUAL_MODULE.switch.is_on(argparse.Namespace(**args)) is on


@pytest.mark.parametrize(
    "arch, options, encoder, decoder",
    [("slot_transformer", [], [], []),
     ("dc_transformer_iwslt", [], [0, 1, 2], []),
     ("dc_transformer_wmt_en_de", ["--dc-encoder-layers", "none", "--dc-decoder-layers", "all"], [], [0, 1]),
     ("dc_transformer_iwslt", ["--dc-decoder-layers", "all"], [0, 1, 2], [0, 1]),
     ("slot_transformer", ["--dc-encoder-layers", "2-3"], [1, 2], [])],
    ids=["off", "enc-dc", "dec-dc", "full-dc", "subset"],
)
def test_layer_options_and_presets(arch, options, encoder, decoder):
    model = build_model(arch, *options)
    assert dc_layers(model.encoder) == encoder
    assert dc_layers(model.decoder) == decoder
    for index in encoder:
        assert model.encoder.layers[index].self_attn.local_unit.kernel_size == 2
    for index in decoder:
        assert model.decoder.layers[index].self_attn.local_unit.causal


def test_dropout_options_reach_every_dc_module():
    """``--dropout`` is the local unit's dropout on r_hat (thesis Eq. 5.4) and
    ``--attention-dropout`` the attention dropout of both FI units (Eqs. 5.5-5.6), in every
    DC layer of both stacks."""
    model = build_model("slot_transformer", *FULL_DC, "--dropout", "0.3", "--attention-dropout", "0.2")
    modules = [stack.layers[i].self_attn for stack in (model.encoder, model.decoder) for i in dc_layers(stack)]
    assert len(modules) == ENCODER_LAYERS + DECODER_LAYERS
    for module in modules:
        assert module.local_unit.dropout_module.p == 0.3
        assert module.local_interaction.dropout_module.p == 0.2
        assert module.global_interaction.dropout_module.p == 0.2


# --- FI-unit diversity ----------------------------------------------------------------------

def test_js_divergence_and_head_reductions():
    p = torch.tensor([[1.0, 0.0], [0.5, 0.5]])
    q = torch.tensor([[0.0, 1.0], [0.5, 0.5]])
    torch.testing.assert_close(js_divergence(p, q), torch.tensor([math.log(2), 0.0], dtype=torch.float64))
    heads = torch.tensor([[[0.9, 0.1]], [[0.2, 0.8]]])  # 2 heads, 1 query row, 2 keys
    torch.testing.assert_close(reduce_heads(heads, "max"), torch.tensor([[0.9, 0.8]]) / 1.7)
    torch.testing.assert_close(reduce_heads(heads, "peak-head"), torch.tensor([[0.9, 0.1]]))


def test_diversity_of_a_model_and_attention_statistics_run_on_dc_encoders():
    dictionary = toy_dictionary()
    model = build_model("slot_transformer", "--dc-encoder-layers", "1,3", dictionary=dictionary)
    src, lengths, _ = random_batch(dictionary)
    accumulator = fi_diversity(model, [(src, lengths)], dictionary.pad())
    assert [row["layer"] for row in accumulator.table()] == [1, 3]
    assert accumulator.rows.tolist() == [int(lengths.sum())] * 2
    assert 0 < accumulator.mean_divergence() < math.log(2)
    stats = encoder_attention_statistics(model, [(src, lengths)], dictionary.pad(), dictionary.eos())
    assert stats.head_entropy().shape == (ENCODER_LAYERS, 2)


# --- command line ---------------------------------------------------------------------------

ROUND_TRIPS = {
    "enc-dc-subset": ["--dc-encoder-layers", "1,3", "--dc-kernel-size", "4"],
    "dec-dc": ["--dc-decoder-layers", "all", "--dc-kernel-size", "3"],
    "full-dc": FULL_DC + PRE_NORM,
}  # the presets (Enc-DC) have their round trip in test_cli_roundtrip.py


@pytest.mark.parametrize("name", ROUND_TRIPS)
def test_train_generate_round_trip(name, data_bin, tmp_path):
    assert_round_trip(data_bin, tmp_path, "slot_transformer", *ROUND_TRIPS[name])
    if name == "enc-dc-subset":
        assert_diversity_cli(tmp_path / "checkpoint_last.pt", data_bin, tmp_path / "diversity")


def assert_diversity_cli(checkpoint, data_bin, prefix):
    """python -m mlmha_fairseq.cli.dc_diversity on the test split: DC layers 1 and 3."""
    subprocess.run(
        [sys.executable, "-m", "mlmha_fairseq.cli.dc_diversity", checkpoint, "--data-bin", data_bin,
         "--split", "test", "--names", "Enc-DC", "--output-prefix", prefix],
        check=True, capture_output=True, text=True,
    )
    result = json.loads(prefix.with_suffix(".json").read_text())["models"]["Enc-DC"]
    assert [row["layer"] for row in result["layers"]] == [1, 3]
    assert result["sentences"] == 16
    assert 0 < result["E_d"] < math.log(2)
    assert prefix.with_suffix(".png").stat().st_size > 0
