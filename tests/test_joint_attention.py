"""MLMHA and layer aggregation inside the slot Transformer (Ampomah et al. 2020; thesis ch. 3)."""
import argparse

import pytest
import torch
from fairseq.modules import MultiheadAttention
from fairseq.sequence_generator import SequenceGenerator

from fairseq_helpers import (
    PRE_NORM,
    assert_beam_search_scores_match_full,
    assert_incremental_matches_full,
    assert_round_trip,
    build_model,
    random_batch,
    run_fairseq,
    toy_dictionary,
    train_args,
)
from mlmha_fairseq.models.joint_attention import COLLECTED_LAYERS, TransparentCrossAttention

VARIANTS = ("M-00", "M-01", "M-10", "M-11")
AGGREGATIONS = ("s-agg", "iter-s-agg", "c-agg", "iter-c-agg", "transparent")
D = 16  # tests/fairseq_helpers.TINY_MODEL_ARGS
ENCODER_LAYERS, DECODER_LAYERS, FFN = 3, 2, 32


def mlmha(variant, *extra):
    return ["--decoder-cross-attention", "multi-layer", "--mlmha-variant", variant, *extra]


def num_params(model):
    return sum(p.numel() for p in model.parameters())


def copy_fairseq_cross_attention(reference, model):
    """Load fairseq's state dict, with each decoder layer's cross-attention projections
    written into the n = 1 MLMHA parameters (q_proj.weight -> q_proj_weight[0], ...)."""
    state = reference.state_dict()
    for i in range(DECODER_LAYERS):
        prefix = f"decoder.layers.{i}.encoder_attn."
        for proj in ("q", "k", "v"):
            for kind in ("weight", "bias"):
                state[f"{prefix}{proj}_proj_{kind}"] = state.pop(f"{prefix}{proj}_proj.{kind}").unsqueeze(0)
    model.load_state_dict(state, strict=True)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("norm", [[], PRE_NORM], ids=["post-norm", "pre-norm"])
def test_n1_equals_fairseq_transformer_with_its_weights(variant, norm):
    dictionary = toy_dictionary()
    reference = build_model("transformer", *norm, dictionary=dictionary)
    model = build_model("slot_transformer", *mlmha(variant, "--mlmha-top-n", "1", "--mlmha-bias"), *norm,
                        dictionary=dictionary)
    copy_fairseq_cross_attention(reference, model)
    reference.eval(), model.eval()
    src, lengths, prev = random_batch(dictionary)
    with torch.no_grad():
        expected, expected_extra = reference(src, lengths, prev)
        got, got_extra = model(src, lengths, prev)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_extra["attn"][0], expected_extra["attn"][0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "options",
    [mlmha(v) for v in VARIANTS] + [["--layer-aggregation", a] for a in AGGREGATIONS],
    ids=list(VARIANTS) + list(AGGREGATIONS),
)
@pytest.mark.parametrize("norm", [[], PRE_NORM], ids=["post-norm", "pre-norm"])
def test_incremental_decoding_matches_full_forward(options, norm):
    dictionary = toy_dictionary()
    model = build_model("slot_transformer", *options, *norm, dictionary=dictionary)
    assert_incremental_matches_full(model, dictionary)


@pytest.mark.parametrize(
    "options",
    [mlmha(v) for v in VARIANTS] + [["--layer-aggregation", "transparent"]],
    ids=list(VARIANTS) + ["transparent"],
)
def test_beam_search_scores_match_the_full_forward(options, monkeypatch):
    torch.manual_seed(0)
    dictionary = toy_dictionary()
    model = build_model("slot_transformer", *options, dictionary=dictionary)
    assert_beam_search_scores_match_full(model, dictionary, monkeypatch)


@pytest.mark.parametrize("options", [mlmha("M-10"), ["--layer-aggregation", "transparent"]],
                         ids=["mlmha", "transparent"])
def test_memory_entries_are_selected_only_when_the_batch_size_changes(options):
    """fairseq's entries follow every order; the package's memory entries (read at the first
    decoding step only) are not copied at an order of the same size, as in beam search."""
    dictionary = toy_dictionary()
    model = build_model("slot_transformer", *options, dictionary=dictionary).eval()
    src, lengths, _ = random_batch(dictionary, batch_size=4)
    with torch.no_grad():
        encoder_out = model.encoder(src, src_lengths=lengths)
    (key,) = model.encoder.memories[next(iter(model.encoder.memories))].output_keys
    kept = model.encoder.reorder_encoder_out(encoder_out, torch.tensor([1, 1, 3, 2]))
    assert kept[key][0] is encoder_out[key][0]
    torch.testing.assert_close(kept["encoder_out"][0], encoder_out["encoder_out"][0][:, [1, 1, 3, 2]])
    shrunk = model.encoder.reorder_encoder_out(encoder_out, torch.tensor([2, 0, 2]))
    torch.testing.assert_close(shrunk[key][0], encoder_out[key][0][..., [2, 0, 2], :])


def test_collected_keys_and_values_are_projected_once_per_sentence():
    dictionary = toy_dictionary()
    model = build_model("slot_transformer", *mlmha("M-10"), dictionary=dictionary).eval()
    calls = []
    for layer in model.decoder.layers:
        attention = layer.encoder_attn
        original = attention._project_taps
        attention._project_taps = lambda taps, original=original: calls.append(1) or original(taps)
    src, lengths, prev = random_batch(dictionary)
    with torch.no_grad():
        encoder_out = model.encoder(src, src_lengths=lengths)
        state = {}
        for step in range(prev.size(1)):
            model.decoder(prev[:, : step + 1], encoder_out=encoder_out, incremental_state=state)
    assert len(calls) == DECODER_LAYERS


def test_transparent_cross_attention_is_fairseqs_over_its_layers_mixture():
    """Transparent Attention (Bapna et al. 2018): decoder layer j runs fairseq's cross-attention
    over its own mixture z_j of the M given; a drop-in for fairseq's MultiheadAttention, it
    takes the arguments after ``value`` by position as well as by name."""
    torch.manual_seed(0)
    layer_idx, heads, src_len, tgt_len, bsz = 1, 4, 5, 3, 2
    attention = TransparentCrossAttention(layer_idx, D, heads, kdim=D, vdim=D,
                                          encoder_decoder_attention=True).eval()
    reference = MultiheadAttention(D, heads, kdim=D, vdim=D, encoder_decoder_attention=True).eval()
    reference.load_state_dict(attention.state_dict())
    mixtures = torch.randn(DECODER_LAYERS, src_len, bsz, D)  # M x Ts x B x C
    query = torch.randn(tgt_len, bsz, D)
    mask = torch.tensor([[False] * src_len, [False] * 3 + [True] * 2])  # row 1: 2 pads
    chosen = mixtures[layer_idx]
    expected, expected_weights = reference(query, chosen, chosen, key_padding_mask=mask, static_kv=True)
    assert expected_weights[1, :, 3:].eq(0).all()
    by_name = attention(query, mixtures, mixtures, key_padding_mask=mask, static_kv=True)
    by_position = attention(query, mixtures, mixtures, mask, None, True, True)
    for out, weights in (by_name, by_position):
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(weights, expected_weights)


@pytest.mark.parametrize("norm", [[], PRE_NORM], ids=["post-norm", "pre-norm"])
def test_generation_sees_every_collected_layer(norm):
    """fairseq's generator calls the encoder without return_all_hiddens: the taps must be
    there anyway, and beam-1 search must equal greedy decoding with full recomputation."""
    dictionary = toy_dictionary()
    model = build_model("slot_transformer", *mlmha("M-00"), *norm, dictionary=dictionary).eval()
    src, lengths, _ = random_batch(dictionary)
    net_input = {"src_tokens": src, "src_lengths": lengths}
    with torch.no_grad():
        encoder_out = model.encoder.forward_torchscript(net_input)
        with_states = model.encoder(src, src_lengths=lengths, return_all_hiddens=True)
    assert encoder_out["encoder_states"] == []
    taps = encoder_out["mlmha_taps"][0]
    assert taps.shape[0] == ENCODER_LAYERS
    torch.testing.assert_close(taps, with_states["mlmha_taps"][0])
    if not norm:  # post-norm: the taps are the layer outputs as they are
        torch.testing.assert_close(taps, torch.stack(with_states["encoder_states"][1:]))

    max_len = 6
    generator = SequenceGenerator([model], dictionary, beam_size=1, max_len_b=max_len)
    hypotheses = generator.generate([model], {"net_input": net_input})
    for row, hypothesis in enumerate(hypotheses):
        assert hypothesis[0]["tokens"].tolist() == greedy_decode(model, dictionary, src[row : row + 1],
                                                                  lengths[row : row + 1], max_len)


def greedy_decode(model, dictionary, src, lengths, max_len):
    """Greedy search by recomputing the full forward pass at every step, with the
    generator's constraints (no pad, no EOS at step 0, EOS at the length limit)."""
    tokens = torch.tensor([[dictionary.eos()]])
    with torch.no_grad():
        for step in range(max_len + 1):
            lprobs = model(src, lengths, tokens)[0][0, -1].log_softmax(-1)
            lprobs[dictionary.pad()] = -float("inf")
            if step == 0:
                lprobs[dictionary.eos()] = -float("inf")
            best = dictionary.eos() if step == max_len else int(lprobs.argmax())
            tokens = torch.cat([tokens, torch.tensor([[best]])], dim=1)
            if best == dictionary.eos():
                break
    return tokens[0, 1:].tolist()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("bias", [False, True])
def test_parameter_count_matches_closed_form(variant, bias):
    """Ampomah et al. 2020, §4.1 (Eqs. 7-12): per decoder layer 3(n-1)d^2 more, plus (n-1)d^2
    for concatenation, against fairseq's cross-attention (which has 4d biases); with biases
    3(n-1)(d^2+d)."""
    n = ENCODER_LAYERS
    concat = variant in ("M-00", "M-10")
    baseline = num_params(build_model("transformer"))
    model = build_model("slot_transformer", *mlmha(variant, *(["--mlmha-bias"] if bias else [])))
    per_layer = 3 * (n - 1) * D**2 + (n - 1) * D**2 * concat
    per_layer += 3 * (n - 1) * D if bias else -4 * D
    assert num_params(model) - baseline == DECODER_LAYERS * per_layer


def test_pre_norm_adds_one_layer_norm_per_collected_layer_below_the_top():
    n = ENCODER_LAYERS
    post = num_params(build_model("slot_transformer", *mlmha("M-01")))
    pre = num_params(build_model("slot_transformer", *mlmha("M-01"), *PRE_NORM))
    fairseq_pre = num_params(build_model("transformer", *PRE_NORM)) - num_params(build_model("transformer"))
    assert pre - post - fairseq_pre == (n - 1) * 2 * D


@pytest.mark.parametrize(
    "aggregation, extra",
    [
        ("s-agg", lambda n: n * D**2),
        ("iter-s-agg", lambda n: 2 * (n - 1) * D**2),
        ("c-agg", lambda n: n * D * FFN + FFN + FFN * D + D + 2 * D),
        ("iter-c-agg", lambda n: (n - 1) * (2 * D * FFN + FFN + FFN * D + D + 2 * D)),
        ("transparent", lambda n: (ENCODER_LAYERS + 1) * DECODER_LAYERS),
    ],
)
@pytest.mark.parametrize("top_n", [2, 3])
def test_aggregation_parameter_count_matches_thesis_formula(aggregation, extra, top_n):
    """Closed forms of the thesis §3.2.1 aggregations (Eqs. 3.1-3.5); Transparent Attention adds
    (L+1) x M scalars (it mixes all encoder states, so --mlmha-top-n does not apply to it)."""
    baseline = num_params(build_model("transformer"))
    top_n_option = [] if aggregation == "transparent" else ["--mlmha-top-n", top_n]
    model = build_model("slot_transformer", "--layer-aggregation", aggregation, *top_n_option)
    assert num_params(model) - baseline == extra(top_n)


def test_paper_size_mlmha_adds_the_papers_parameters():
    """WMT'14 En-De preset (d=512, 6+6, n=6, M-10): 6 x 20 d^2 = 31,457,280 new weights
    (Ampomah et al. 2020: "about 23.7M ... a further 7.8M"), minus fairseq's 6 x 4d cross-attention biases,
    plus the pre-norm LayerNorms of the n-1 collected layers below the top (5 x 2d)."""
    words = [f"w{i}" for i in range(1000)]
    dictionary = toy_dictionary(words)
    paper_size = ["--encoder-layers", "6", "--decoder-layers", "6", "--encoder-embed-dim", "512",
                  "--decoder-embed-dim", "512", "--encoder-ffn-embed-dim", "2048",
                  "--decoder-ffn-embed-dim", "2048", "--encoder-attention-heads", "8",
                  "--decoder-attention-heads", "8", "--share-all-embeddings"]
    baseline = num_params(build_model("transformer_wmt_en_de", *paper_size, *PRE_NORM, dictionary=dictionary))
    model = build_model("mlmha_transformer_wmt_en_de", *paper_size, dictionary=dictionary)
    assert model.decoder.layers[0].encoder_attn.num_taps == 6
    assert num_params(model) - baseline == 31_457_280 - 6 * 4 * 512 + 5 * 2 * 512
    post_norm = build_model("mlmha_transformer_wmt_en_de_post_norm", *paper_size, dictionary=dictionary)
    post_norm_baseline = num_params(build_model("transformer_wmt_en_de", *paper_size, dictionary=dictionary))
    assert num_params(post_norm) - post_norm_baseline == 31_457_280 - 6 * 4 * 512


@pytest.mark.parametrize("bias", [False, True])
def test_masking_an_encoder_layer_zero_vs_drop(bias):
    """Table 7 ablation: with bias-free projections zeroing the collected state equals
    dropping its logits and context; with biases the two readings differ."""
    dictionary = toy_dictionary()
    options = mlmha("M-00", *(["--mlmha-bias"] if bias else []))
    torch.manual_seed(0)
    plain = build_model("slot_transformer", *options, dictionary=dictionary).eval()
    outputs = {}
    for mode in ("zero", "drop"):
        masked = build_model("slot_transformer", *options, "--mlmha-mask-encoder-layer", "2",
                             "--mlmha-mask-mode", mode, dictionary=dictionary).eval()
        masked.load_state_dict(plain.state_dict())
        src, lengths, prev = random_batch(dictionary)
        with torch.no_grad():
            outputs[mode] = masked(src, lengths, prev)[0]
            unmasked = plain(src, lengths, prev)[0]
        assert not torch.allclose(outputs[mode], unmasked)
    assert torch.allclose(outputs["zero"], outputs["drop"], atol=1e-5) != bias


@pytest.mark.parametrize(
    "options, message",
    [
        (mlmha("M-00", "--mlmha-top-n", "4"), "--mlmha-top-n 4 needs 1 <= n <= 3"),
        (mlmha("M-00", "--mlmha-top-n", "2", "--mlmha-mask-encoder-layer", "1"),
         "only encoder layers 2..3 are collected"),
        (["--layer-aggregation", "s-agg", *mlmha("M-00")], "layer_aggregation replaces the encoder output .* attends to 'mlmha_taps'"),
    ],
)
def test_bad_configurations_are_refused_with_a_clear_message(options, message):
    with pytest.raises(ValueError, match=message):
        build_model("slot_transformer", *options)


def test_fairseq_train_exits_non_zero_on_a_bad_top_n(data_bin, tmp_path):
    result = run_fairseq("train", *train_args(data_bin, tmp_path, "slot_transformer", *mlmha("M-00"),
                                              "--mlmha-top-n", "7"), check=False)
    assert result.returncode != 0
    assert "--mlmha-top-n 7 needs 1 <= n <= 3" in result.stderr
    assert not (tmp_path / "checkpoint_last.pt").exists()


@pytest.mark.parametrize(
    "options",
    [mlmha(v) for v in VARIANTS] + [["--layer-aggregation", a] for a in AGGREGATIONS],
    ids=list(VARIANTS) + list(AGGREGATIONS),
)
def test_train_generate_round_trip(options, data_bin, tmp_path):
    assert_round_trip(data_bin, tmp_path, "slot_transformer", *options)


def test_mask_ablation_at_generation_time(data_bin, tmp_path):
    assert_round_trip(
        data_bin, tmp_path, "slot_transformer", *mlmha("M-10"),
        generate_options=["--model-overrides", "{'mlmha_mask_encoder_layer': 2, 'mlmha_mask_mode': 'drop'}"],
    )


@pytest.mark.parametrize(
    "sharing, saved_per_layer",
    [(["--mlmha-share-query"], (ENCODER_LAYERS - 1) * D**2),
     (["--mlmha-share-kv"], 2 * (ENCODER_LAYERS - 1) * D**2),
     (["--mlmha-share-query", "--mlmha-share-kv"], 3 * (ENCODER_LAYERS - 1) * D**2)],
    ids=["share-query", "share-kv", "share-both"],
)
def test_sharing_options_remove_the_per_layer_projections(sharing, saved_per_layer):
    """--mlmha-share-query keeps one of the n query projections, --mlmha-share-kv one of the
    n key/value pairs, in every decoder layer; decoding stays incremental."""
    dictionary = toy_dictionary()
    model = build_model("slot_transformer", *mlmha("M-10", *sharing), dictionary=dictionary)
    default = build_model("slot_transformer", *mlmha("M-10"))
    assert num_params(default) - num_params(model) == DECODER_LAYERS * saved_per_layer
    assert_incremental_matches_full(model, dictionary)


@pytest.mark.parametrize("layer", [2, 3])
def test_the_lowest_and_the_top_collected_layer_can_be_masked(layer):
    """``--mlmha-mask-encoder-layer L`` accepts every collected layer, the lowest included:
    with 3 encoder layers and ``--mlmha-top-n 2`` the taps are layers 2 and 3, so layer L is
    tap L - 2. Zero mode zeroes that tap in the encoder's ``mlmha_taps`` output; drop mode
    leaves the taps as they are and drops that tap in every decoder layer's MLMHA."""
    dictionary = toy_dictionary()
    options = mlmha("M-00", "--mlmha-top-n", "2")
    torch.manual_seed(0)
    plain = build_model("slot_transformer", *options, dictionary=dictionary).eval()
    src, lengths, _ = random_batch(dictionary)
    with torch.no_grad():
        taps = plain.encoder(src, lengths)["mlmha_taps"][0]
    expected = {"zero": taps.clone(), "drop": taps}
    expected["zero"][layer - 2] = 0
    dropped = {"zero": None, "drop": layer - 2}
    for mode in ("zero", "drop"):
        masked = build_model("slot_transformer", *options, "--mlmha-mask-encoder-layer", str(layer),
                             "--mlmha-mask-mode", mode, dictionary=dictionary).eval()
        masked.load_state_dict(plain.state_dict())
        with torch.no_grad():
            torch.testing.assert_close(masked.encoder(src, lengths)["mlmha_taps"][0], expected[mode])
        assert [l.encoder_attn.dropped_layer_index for l in masked.decoder.layers] == \
            [dropped[mode]] * DECODER_LAYERS


@pytest.mark.parametrize(
    "args, on",
    [({}, False),
     ({"decoder_cross_attention": "multi-layer"}, True),
     ({"layer_aggregation": "c-agg"}, True),
     ({"layer_aggregation": "linear-combination"}, True),
     ({"layer_aggregation": "transparent"}, False),
     ({"layer_aggregation": "none", "decoder_cross_attention": "default"}, False)],
    ids=["no options", "mlmha", "c-agg", "alias", "transparent", "off"],
)
def test_layer_collection_is_on_for_mlmha_and_the_aggregations_only(args, on):
    """The switch of the set-while-off check of ``--mlmha-top-n`` and the masking options:
    MLMHA and the four thesis aggregations (and their aliases) collect the top-n layers;
    transparent attention mixes all states and collects none; args without the options (a
    preset's before the defaults are filled) read as off."""
    assert COLLECTED_LAYERS.switch.is_on(argparse.Namespace(**args)) is on


@pytest.mark.parametrize("joint, layer_specific", [("M-00", "M-10"), ("M-01", "M-11")])
def test_the_variant_option_chooses_joint_or_layer_specific_weights(joint, layer_specific):
    """``--mlmha-variant`` reaches the decoder's attention: with the same weights (the two
    variants have the same parameters) a joint distribution over all collected layers' keys
    gives other logits than one distribution per layer."""
    dictionary = toy_dictionary()
    torch.manual_seed(0)
    models = [build_model("slot_transformer", "--decoder-cross-attention", "multi-layer", "--mlmha-variant", variant,
                          dictionary=dictionary).eval() for variant in (joint, layer_specific)]
    models[1].load_state_dict(models[0].state_dict())
    src, lengths, prev = random_batch(dictionary)
    with torch.no_grad():
        logits = [model(src, lengths, prev)[0] for model in models]
    assert not torch.allclose(logits[0], logits[1], atol=1e-4)


def test_dlcl_over_a_one_layer_encoder_builds():
    """DLCL needs one encoder layer, no more: its matrix is then 2 x 2 (the layer's input and
    the encoder output)."""
    model = build_model("slot_transformer", "--dlcl-encoder", "--encoder-layers", "1")
    assert len(model.encoder.layer_inputs.weights) == 2
