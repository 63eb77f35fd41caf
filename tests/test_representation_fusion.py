"""Multi-layer Representation Fusion, MLRF (Wang et al. 2018)."""
import argparse
import dataclasses
import itertools
import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from fairseq import options, tasks
from fairseq.data import Dictionary

from fairseq_helpers import (
    PRE_NORM,
    TINY_MODEL_ARGS,
    USER_DIR,
    assert_incremental_matches_full,
    assert_round_trip,
    build_model,
    full_logits,
    random_batch,
    run_fairseq,
    toy_dictionary,
    train_args,
)
from fixtures.tiny_fairseq import build_task_and_model, save_checkpoint, write_data_bin
from mlmha_fairseq.cli import mlrf_hop_weights
from mlmha_fairseq.errors import UsageError
from mlmha_fairseq.models.representation_fusion import MLRF, _needs
from mlmha_fairseq.modules.representation_fusion import (
    AverageFusion,
    FusionOptions,
    LayerAttention,
    build_fusion,
    build_layer_embedding,
)

D = 16  # tests/fairseq_helpers.TINY_MODEL_ARGS
ENCODER_LAYERS, DECODER_LAYERS = 3, 2
SA_SIZES = ["--mlrf-attention-dim", "12", "--mlrf-hops", "3"]
FFN_SIZES = ["--mlrf-ffn-dim", "20"]
D_A, D_F, HOPS = 12, 20, 3


def fusion(encoder="none", decoder="none", *extra):
    """MLRF options with the small sizes above, those of the functions in use (an option of
    a function no side uses is refused)."""
    functions = {encoder, decoder}
    sizes = (SA_SIZES if "sa" in functions else []) + (FFN_SIZES if functions & {"fnn", "sa"} else [])
    return ["--mlrf-encoder-fusion", encoder, "--mlrf-decoder-fusion", decoder, *sizes, *extra]


def num_params(model):
    return sum(p.numel() for p in model.parameters())


def stacked_states(num_states=4, length=5, bsz=3, dim=D, seed=0):
    return torch.randn(num_states, length, bsz, dim, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- the modules


@pytest.mark.parametrize("layer_norm", [True, False])
def test_avg_is_the_mean_of_the_k_states_then_layer_norm(layer_norm):
    states = stacked_states()
    avg = build_fusion("avg", 4, D, FusionOptions(average_layer_norm=layer_norm))
    mean = (states[0] + states[1] + states[2] + states[3]) / 4
    expected = F.layer_norm(mean, (D,)) if layer_norm else mean
    torch.testing.assert_close(avg(states, torch.randn(4, D)), expected)


@pytest.mark.parametrize("hops", [1, 3])
@pytest.mark.parametrize("num_states", [2, 5])
@pytest.mark.parametrize("independent_w1", [False, True])
def test_sa_hop_weights_sum_to_one_over_layers(hops, num_states, independent_w1):
    states = stacked_states(num_states)
    options = FusionOptions(hops=hops, attention_dim=D_A, ffn_dim=D_F, independent_w1=independent_w1)
    sa = build_fusion("sa", num_states, D, options)
    weights = sa.attention(states)
    assert weights.shape == (5, 3, hops, num_states)  # T x B x n_hop x K
    torch.testing.assert_close(weights.sum(-1), torch.ones(5, 3, hops))
    assert sa(states, torch.randn(num_states, D)).shape == (5, 3, D)
    assert sa.ffn.fc1.in_features == hops * D


def test_sa_computes_equations_4_to_7():
    """Eq. 4 z~ = z + E; Eq. 5 e = W2 tanh(W1 z~); Eq. 6 softmax over layers; Eq. 7
    s~_p = sum_l a_p^l z~^l; then FNN over [s~_1; ...; s~_n] (hop-major) and LayerNorm."""
    states, embedding = stacked_states(), torch.randn(4, D)
    sa = build_fusion("sa", 4, D, FusionOptions(hops=HOPS, attention_dim=D_A, ffn_dim=D_F))
    z = states + embedding[:, None, None, :]  # K x T x B x C
    w1, w2 = sa.attention.w1.weight, sa.attention.w2.weight  # d_a x C, n_hop x d_a
    energies = torch.tanh(z @ w1.T) @ w2.T  # K x T x B x n_hop
    a = torch.softmax(energies, dim=0)
    hops = [(a[:, :, :, p, None] * z).sum(0) for p in range(HOPS)]  # n_hop of T x B x C
    hidden = F.relu(sa.ffn.fc1(torch.cat(hops, dim=-1)))
    expected = F.layer_norm(sa.ffn.fc2(hidden), (D,), sa.layer_norm.weight, sa.layer_norm.bias)
    torch.testing.assert_close(sa(states, embedding), expected)


def test_avg_module_applies_the_layer_norm_by_default():
    """AVG is ``LN((1/K) sum_l z_j^l)`` (Wang et al. 2018, §3.2, with the LayerNorm after the
    fusion layer) unless the LayerNorm is turned off explicitly."""
    states = stacked_states()
    default = AverageFusion(D)
    assert isinstance(default.layer_norm, torch.nn.LayerNorm)
    torch.testing.assert_close(default(states), F.layer_norm(states.mean(0), (D,)))


def test_layer_embedding_is_initialised_uniformly_in_plus_minus_0_1():
    """[paper] §4.2: the layer embedding ``E`` (Eq. 4) is initialised with U(-0.1, 0.1); one
    row per layer number, none of them zeroed (no padding row)."""
    torch.manual_seed(0)
    table = build_layer_embedding(4, D)
    assert table.weight.shape == (4, D) and table.padding_idx is None
    values = table.weight.detach()
    assert values.abs().max() <= 0.1
    # both signs, spread over the range (64 draws of U(-0.1, 0.1))
    assert values.min() < -0.05 and values.max() > 0.05
    assert values.unique().numel() == 4 * D
    assert values.abs().sum(dim=-1).gt(0).all()


@pytest.mark.parametrize("attention_bias", [False, True])
def test_independent_w1_is_initialised_like_a_linear_layer(attention_bias):
    """[paper] §4.2, PyTorch's default init: every layer's W1 (and bias) is
    ``U(-1/sqrt(C), 1/sqrt(C))``, C the fan-in, the same as the shared ``nn.Linear(C, d_a)``."""
    torch.manual_seed(0)
    options = FusionOptions(hops=HOPS, attention_dim=D_A, ffn_dim=D_F, independent_w1=True,
                            attention_bias=attention_bias)
    attention = LayerAttention(4, D, options)
    bound = 1 / math.sqrt(D)
    parameters = [attention.w1] + ([attention.w1_bias] if attention_bias else [])
    assert (attention.w1_bias is not None) == attention_bias
    for parameter, size in zip(parameters, (4 * D * D_A, 4 * D_A)):
        assert parameter.numel() == size
        values = parameter.detach()
        assert values.abs().max() <= bound
        # both signs, spread over the range (768 and 48 draws of U(-b, b))
        assert values.min() < -bound / 2 and values.max() > bound / 2
        assert values.unique().numel() == size


def test_independent_w1_with_biases_computes_equations_5_and_6():
    """Wang et al. 2018, Eqs. 5-6 with "+ indep. W1" (footnote 4) and the biases on:
    ``e_p^l = W2_p^T tanh(W1_l^T z~^l + b1_l) + b2_p``, ``a_p^l = softmax_l(e_p^l)``."""
    torch.manual_seed(0)
    options = FusionOptions(hops=HOPS, attention_dim=D_A, ffn_dim=D_F, independent_w1=True,
                            attention_bias=True)
    attention = LayerAttention(4, D, options).double()
    states = stacked_states().double()  # z~: K x T x B x C
    w1, b1 = attention.w1.detach(), attention.w1_bias.detach()  # K x C x d_a, K x d_a
    w2, b2 = attention.w2.weight.detach(), attention.w2.bias.detach()  # n_hop x d_a, n_hop
    energies = torch.stack([torch.tanh(states[l] @ w1[l] + b1[l]) @ w2.T + b2 for l in range(4)])
    expected = torch.softmax(energies, dim=0).permute(1, 2, 3, 0)  # T x B x n_hop x K
    torch.testing.assert_close(attention(states), expected)


def test_independent_w1_has_one_matrix_per_layer():
    options = FusionOptions(hops=HOPS, attention_dim=D_A, ffn_dim=D_F)
    shared = LayerAttention(4, D, options)
    independent = LayerAttention(4, D, dataclasses.replace(options, independent_w1=True))
    assert independent.w1.shape == (4, D, D_A)  # K x C x d_a
    independent.w2.load_state_dict(shared.w2.state_dict())
    states = stacked_states()
    with torch.no_grad():
        independent.w1.copy_(shared.w1.weight.T.expand(4, D, D_A))
        torch.testing.assert_close(independent(states), shared(states))
        independent.w1[2] += 1.0  # only layer 2's energies change
        changed = independent(states) != shared(states)
    assert changed.all()  # the softmax over layers spreads layer 2's change to every weight


def test_fnn_concatenates_the_layers_bottom_to_top():
    states, embedding = stacked_states(3), torch.randn(3, D)
    fnn = build_fusion("fnn", 3, D, FusionOptions(ffn_dim=D_F))
    z = states + embedding[:, None, None, :]
    hidden = F.relu(fnn.ffn.fc1(torch.cat([z[0], z[1], z[2]], dim=-1)))
    expected = F.layer_norm(fnn.ffn.fc2(hidden), (D,), fnn.layer_norm.weight, fnn.layer_norm.bias)
    torch.testing.assert_close(fnn(states, embedding), expected)


def test_fnn_layer_embedding_is_a_first_layer_bias():
    """Wang et al. 2018, Eq. 4: before a linear layer, adding E is the bias W_a [E_0; ...; E_L]."""
    states, embedding = stacked_states(3), torch.randn(3, D)
    fnn = build_fusion("fnn", 3, D, FusionOptions(ffn_dim=D_F))
    with_embedding = fnn(states, embedding)
    with torch.no_grad():
        fnn.ffn.fc1.bias += fnn.ffn.fc1.weight @ embedding.reshape(-1)
    torch.testing.assert_close(fnn(states, None), with_embedding)


@pytest.mark.parametrize("function", ["avg", "fnn", "sa"])
def test_one_fused_state_is_allowed_and_none_is_refused(function):
    """K = 1 (e.g. one layer with --mlrf-no-embedding-layer) is a valid fusion: AVG is
    ``LN(z)``, FNN is ``LN(FNN(z~))``, and SA's softmax over one layer gives every hop the
    weight 1, so ``s~_p = z~`` for every hop (Wang et al. 2018, Eqs. 6-7). K = 0 is refused."""
    torch.manual_seed(0)
    states, embedding = stacked_states(1).double(), torch.randn(1, D, dtype=torch.float64)
    module = build_fusion(function, 1, D, FusionOptions(hops=HOPS, attention_dim=D_A, ffn_dim=D_F)).double()
    if function == "avg":
        expected = F.layer_norm(states[0], (D,))
    else:
        z = states[0] + embedding[0]
        flat = torch.cat([z] * HOPS, dim=-1) if function == "sa" else z
        hidden = F.relu(flat @ module.ffn.fc1.weight.T + module.ffn.fc1.bias)
        expected = F.layer_norm(hidden @ module.ffn.fc2.weight.T + module.ffn.fc2.bias, (D,),
                                module.layer_norm.weight, module.layer_norm.bias)
    if function == "sa":
        assert torch.equal(module.attention(states + embedding[:, None, None, :]),
                           torch.ones(5, 3, HOPS, 1, dtype=torch.float64))
    torch.testing.assert_close(module(states, embedding), expected)
    with pytest.raises(ValueError, match="the number of fused layers K must be >= 1, got 0"):
        build_fusion(function, 0, D, FusionOptions())


def test_unknown_fusion_function_is_refused():
    with pytest.raises(ValueError, match="unknown fusion function 'max'"):
        build_fusion("max", 3, D, FusionOptions())


# ----------------------------------------------------------------------------- parameter counts

# Wang et al. 2018, Table 2 (IWSLT De-En): d=256, FFN 1024, 3+3 layers, separate vocabularies
# 8,389 / 6,428, K = L + 1 = 4, d_f = 512, d_a = 1024. "computed" counts the paper's output
# bias b_o (Eq. 2), which fairseq's output projection does not have.
SRC_VOCAB, TGT_VOCAB = 8389, 6428
OUTPUT_BIAS = TGT_VOCAB
ENC, DEC = "--mlrf-encoder-fusion", "--mlrf-decoder-fusion"
PAPER_TABLE_2 = {
    # system: (options, computed from the equations, the paper's #Param. in millions)
    "Transformer": ([], 10_974_748, 10.97),
    "+RestartAdam-4Layers": (["--encoder-layers", "4", "--decoder-layers", "4"], 12_817_948, 12.82),
    "+RestartAdam-6Layers": (["--encoder-layers", "6", "--decoder-layers", "6"], 16_504_348, 16.50),
    "Enc-FNN": ([ENC, "fnn"], 11_632_412, 11.63),
    "Dec-FNN": ([DEC, "fnn"], 11_632_412, 11.63),
    "Enc-SA (nhop=4)": ([ENC, "sa"], 11_898_652, 11.90),
    "Dec-SA (nhop=4)": ([DEC, "sa"], 11_898_652, 11.90),
    "Enc-SA (nhop=6)": ([ENC, "sa", "--mlrf-hops", "6"], 12_162_844, 12.16),
    "Dec-SA (nhop=6)": ([DEC, "sa", "--mlrf-hops", "6"], 12_162_844, 13.47),
    "Both-FNN": ([ENC, "fnn", DEC, "fnn"], 12_289_052, 12.29),
    "Both-SA (nhop=4)": ([ENC, "sa", DEC, "sa"], 12_821_532, 12.82),
    "Both-FNN-SA (nhop=4)": ([ENC, "fnn", DEC, "sa"], 12_555_292, 12.55),
    "Enc-AVG (no LayerNorm)": ([ENC, "avg", "--mlrf-no-avg-layernorm"], 10_974_748, 10.97),
    "Enc-AVG": ([ENC, "avg"], 10_974_748 + 2 * 256, 10.97),
    "Dec-AVG": ([DEC, "avg"], 10_974_748 + 2 * 256, 10.97),
}
# The paper's printed counts that the formulas do not round to (documented in the README).
PAPER_ANOMALIES = {
    "Dec-SA (nhop=6)": "13.47M printed; the formula gives Enc-SA(6)'s 12.16M (a typo)",
    "Both-FNN-SA (nhop=4)": "12.555M printed as 12.55M",
    "Enc-AVG": "the LayerNorm after AVG adds 2d = 512 (10.975M); the paper prints 10.97M",
    "Dec-AVG": "as Enc-AVG",
}


def paper_model(arch, *extra):
    """A model with the paper's separate source and target vocabulary sizes."""
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(
        parser, ["unused", "--task", "translation", "--user-dir", USER_DIR, "--arch", arch, *extra])
    src_dict, tgt_dict = Dictionary(), Dictionary()
    for dictionary, size in ((src_dict, SRC_VOCAB), (tgt_dict, TGT_VOCAB)):
        for i in range(size - dictionary.nspecial):
            dictionary.add_symbol(f"w{i}")
    return tasks.translation.TranslationTask(args, src_dict, tgt_dict).build_model(args)


@pytest.mark.parametrize("system", PAPER_TABLE_2)
def test_parameter_counts_match_the_closed_form_and_table_2(system):
    extra, computed, paper = PAPER_TABLE_2[system]
    model = paper_model("mlrf_transformer_iwslt_de_en", ENC, "none", DEC, "none", *extra)
    assert num_params(model) + OUTPUT_BIAS == computed
    assert (round(computed / 1e6, 2) == paper) != (system in PAPER_ANOMALIES)


def test_iwslt_preset_is_the_papers_best_de_en_system():
    model = paper_model("mlrf_transformer_iwslt_de_en")
    assert num_params(model) + OUTPUT_BIAS == PAPER_TABLE_2["Both-FNN-SA (nhop=4)"][1]
    assert model.encoder.embed_tokens is not model.decoder.embed_tokens  # separate vocabularies
    assert model.decoder.output_projection.weight is not model.decoder.embed_tokens.weight
    assert model.decoder.output_fusion.fusion.attention.w2.out_features == 4


@pytest.mark.parametrize(
    "options, extra",
    [
        (fusion("fnn"), (ENCODER_LAYERS + 1) * D * D_F + D_F + D_F * D + D + 2 * D
         + (ENCODER_LAYERS + 1) * D),
        (fusion("fnn", "none", "--mlrf-no-embedding-layer"),  # K = L, rows for layers 1..L only
         ENCODER_LAYERS * D * D_F + D_F + D_F * D + D + 2 * D + ENCODER_LAYERS * D),
        (fusion("fnn", "none", "--mlrf-no-layer-embedding"),
         (ENCODER_LAYERS + 1) * D * D_F + D_F + D_F * D + D + 2 * D),
        (fusion("none", "sa"), D * D_A + D_A * HOPS + HOPS * D * D_F + D_F + D_F * D + D + 2 * D
         + (DECODER_LAYERS + 1) * D),
        (fusion("none", "sa", "--mlrf-indep-w1"),  # one W1 per fused layer
         (DECODER_LAYERS + 1) * D * D_A + D_A * HOPS + HOPS * D * D_F + D_F + D_F * D + D + 2 * D
         + (DECODER_LAYERS + 1) * D),
        (fusion("none", "sa", "--mlrf-attention-bias"),
         D * D_A + D_A + D_A * HOPS + HOPS + HOPS * D * D_F + D_F + D_F * D + D + 2 * D
         + (DECODER_LAYERS + 1) * D),
        (fusion("avg", "avg"), 2 * (2 * D)),
        # one shared table of max(L_enc, L_dec) + 1 rows, counted once
        (fusion("sa", "fnn"), D * D_A + D_A * HOPS + HOPS * D * D_F + D_F + D_F * D + D + 2 * D
         + (DECODER_LAYERS + 1) * D * D_F + D_F + D_F * D + D + 2 * D + (ENCODER_LAYERS + 1) * D),
    ],
    ids=["Enc-FNN", "Enc-FNN no word emb", "Enc-FNN no layer emb", "Dec-SA", "Dec-SA indep W1",
         "Dec-SA biases", "Both-AVG", "Both-SA-FNN"],
)
def test_parameter_count_closed_forms(options, extra):
    baseline = num_params(build_model("slot_transformer"))
    assert num_params(build_model("slot_transformer", *options)) - baseline == extra


def test_encoder_and_decoder_of_different_widths_each_fuse_at_their_own_width():
    """Without the shared layer embedding (--mlrf-no-layer-embedding) the two sides may have
    different widths C; each fusion works at its own side's width, and the fusion is given no
    layer embedding: the decoder's SA is Wang et al. 2018, Eqs. 5-7 on ``z~ = z`` (Eq. 4 without E)."""
    torch.manual_seed(0)
    dictionary = toy_dictionary()
    model = build_model("slot_transformer", *fusion("fnn", "sa", "--mlrf-no-layer-embedding"),
                        "--decoder-embed-dim", "8", dictionary=dictionary)
    memory, output = model.encoder.memories["mlrf_fusion"], model.decoder.output_fusion
    assert memory.layer_embedding is None and output.layer_embedding is None
    assert (memory.fusion.ffn.fc1.in_features, memory.fusion.ffn.fc2.out_features) == ((ENCODER_LAYERS + 1) * D, D)
    assert memory.fusion.layer_norm.weight.shape == (D,)
    sa = output.fusion
    assert (sa.attention.w1.in_features, sa.ffn.fc1.in_features, sa.ffn.fc2.out_features) == (8, HOPS * 8, 8)
    assert sa.layer_norm.weight.shape == (8,)
    src, lengths, prev = random_batch(dictionary)
    with torch.no_grad():
        assert model(src, lengths, prev)[0].shape == (*prev.shape, len(dictionary))
        z = stacked_states(DECODER_LAYERS + 1, dim=8).double()
        output.double()
        energies = torch.tanh(z @ sa.attention.w1.weight.T) @ sa.attention.w2.weight.T  # K x T x B x n_hop
        a = torch.softmax(energies, dim=0)
        hops = torch.cat([(a[..., p, None] * z).sum(0) for p in range(HOPS)], dim=-1)
        hidden = torch.relu(hops @ sa.ffn.fc1.weight.T + sa.ffn.fc1.bias)
        expected = F.layer_norm(hidden @ sa.ffn.fc2.weight.T + sa.ffn.fc2.bias, (8,), sa.layer_norm.weight,
                                sa.layer_norm.bias)
        # the hop weights are computed in fp32, as fairseq's attention
        torch.testing.assert_close(output(list(z)), expected, atol=1e-6, rtol=1e-5)


def test_nist_preset_is_dec_sa_with_independent_w1():
    model = build_model("mlrf_transformer_nist")
    assert len(model.encoder.memories) == 0
    attention = model.decoder.output_fusion.fusion.attention
    assert attention.w1.shape == (DECODER_LAYERS + 1, D, 1024) and attention.w2.out_features == 4
    assert model.encoder.embed_tokens is not model.decoder.embed_tokens


@pytest.mark.parametrize("preset", ["mlrf_transformer_iwslt_de_en", "mlrf_transformer_nist"])
def test_presets_use_the_papers_dropout_and_embeddings_unless_set(preset):
    """Wang et al. 2018, §4.2: residual dropout 0.1 and separate, untied source, target and
    output embeddings by default; a --dropout or an embedding-sharing flag given by the user
    is kept."""
    model = build_model(preset)
    assert model.encoder.dropout_module.p == model.decoder.dropout_module.p == 0.1
    assert model.encoder.embed_tokens is not model.decoder.embed_tokens
    assert model.decoder.output_projection.weight is not model.decoder.embed_tokens.weight
    model = build_model(preset, "--dropout", "0.3", "--share-all-embeddings")
    assert model.encoder.dropout_module.p == model.decoder.dropout_module.p == 0.3
    assert model.encoder.embed_tokens is model.decoder.embed_tokens
    assert model.decoder.output_projection.weight is model.decoder.embed_tokens.weight
    model = build_model(preset, "--share-decoder-input-output-embed")
    assert model.encoder.embed_tokens is not model.decoder.embed_tokens
    assert model.decoder.output_projection.weight is model.decoder.embed_tokens.weight


# ----------------------------------------------------------------------------- the shared table


def test_one_layer_embedding_table_is_shared_and_survives_a_checkpoint(tmp_path):
    dictionary = toy_dictionary()
    model = build_model("slot_transformer", *fusion("sa", "sa"), dictionary=dictionary)
    table = model.encoder.memories["mlrf_fusion"].layer_embedding
    assert model.decoder.output_fusion.layer_embedding is table
    assert table.weight.shape == (max(ENCODER_LAYERS, DECODER_LAYERS) + 1, D)
    state = model.state_dict()
    keys = ("encoder.memories.mlrf_fusion.layer_embedding.weight", "decoder.output_fusion.layer_embedding.weight")
    assert state[keys[0]].data_ptr() == state[keys[1]].data_ptr()  # both keys, one tensor
    torch.save(state, tmp_path / "model.pt")
    loaded = build_model("slot_transformer", *fusion("sa", "sa"), dictionary=dictionary)
    loaded.load_state_dict(torch.load(tmp_path / "model.pt"), strict=True)
    assert loaded.decoder.output_fusion.layer_embedding is loaded.encoder.memories["mlrf_fusion"].layer_embedding
    torch.testing.assert_close(loaded.encoder.memories["mlrf_fusion"].layer_embedding.weight, table.weight)
    optimizer = torch.optim.Adam(loaded.parameters())  # the table is one parameter
    assert sum(p.numel() for g in optimizer.param_groups for p in g["params"]) == num_params(loaded)


def test_layer_embedding_rows_are_indexed_by_layer_number():
    """Without the embedding layer, layers 1..L get rows 0..L-1 and no row is allocated
    for layer 0."""
    model = build_model("slot_transformer", *fusion("none", "fnn", "--mlrf-no-embedding-layer"))
    output = model.decoder.output_fusion
    assert output.layer_embedding.weight.shape == (DECODER_LAYERS, D)
    states = list(stacked_states(DECODER_LAYERS + 1))
    seen = {}
    output.fusion.forward = lambda stacked, rows: seen.update(stacked=stacked, rows=rows)
    output(states)
    torch.testing.assert_close(seen["stacked"], torch.stack(states[1:]))
    torch.testing.assert_close(seen["rows"], output.layer_embedding.weight)


@pytest.mark.parametrize(
    "options",
    [fusion("sa", "fnn", "--mlrf-no-embedding-layer"), fusion("none", "sa", "--mlrf-no-embedding-layer"),
     fusion("fnn", "sa", "--decoder-layers", "4", "--mlrf-no-embedding-layer"), fusion("sa", "fnn")],
    ids=["Both-SA-FNN no word emb", "Dec-SA no word emb", "Both-FNN-SA deeper decoder no word emb",
         "Both-SA-FNN"],
)
def test_every_parameter_receives_a_gradient(options):
    """No dead parameter: in particular no layer-embedding row for an unfused layer."""
    dictionary = toy_dictionary()
    model = build_model("slot_transformer", *options, dictionary=dictionary)
    src, lengths, prev = random_batch(dictionary)
    model(src, lengths, prev)[0].logsumexp(-1).sum().backward()
    dead = [name for name, p in model.named_parameters() if p.grad is None or not p.grad.any()]
    assert dead == []
    # per row for the layer-embedding table (a tensor-level check misses an unused row)
    table = next(p for name, p in model.named_parameters() if name.endswith("layer_embedding.weight"))
    assert table.grad.abs().sum(dim=-1).gt(0).all()


# Made before the table lost its unused row, by tests/fixtures: build_model("slot_transformer",
# *fixture["options"]) with torch.manual_seed(0) and toy_dictionary(), its state dict and its
# logits on random_batch(toy_dictionary()); its table has max(L) + 1 = 4 rows.
OLD_TABLE_FIXTURE = Path(__file__).parent / "fixtures" / "mlrf_old_layer_embedding_table.pt"


def test_checkpoint_with_the_old_layer_embedding_table_loads_and_gives_the_same_output():
    fixture = torch.load(OLD_TABLE_FIXTURE, weights_only=True)
    old_table = fixture["model"]["encoder.memories.mlrf_fusion.layer_embedding.weight"]
    assert old_table.shape == (ENCODER_LAYERS + 1, D)
    dictionary = toy_dictionary()
    model = build_model("slot_transformer", *fixture["options"], dictionary=dictionary).eval()
    model.load_state_dict(fixture["model"], strict=True)  # fairseq's, which upgrades first
    table = model.encoder.memories["mlrf_fusion"].layer_embedding
    assert model.decoder.output_fusion.layer_embedding is table
    torch.testing.assert_close(table.weight, old_table[1:])
    src, lengths, prev = random_batch(dictionary)
    with torch.no_grad():
        torch.testing.assert_close(full_logits(model, src, lengths, prev), fixture["logits"])


def test_old_table_upgrade_applies_only_without_the_embedding_layer():
    """The upgrade of checkpoints from before the table lost its unused row drops row 0 only
    with --mlrf-no-embedding-layer; when layer 0 is fused, a table with one row too many is
    left as it is (strict loading then reports the mismatch instead of losing a trained row)."""
    key = "decoder.output_fusion.layer_embedding.weight"
    rows = torch.arange(DECODER_LAYERS + 2.0)[:, None].expand(-1, D)  # row r holds r
    fused_layer_0 = build_model("slot_transformer", *fusion("none", "fnn")).decoder.output_fusion
    state = {key: rows}
    fused_layer_0.upgrade_state_dict_named(state, "decoder.output_fusion")
    assert state[key] is rows
    without_layer_0 = build_model("slot_transformer", *fusion("none", "fnn", "--mlrf-no-embedding-layer"))
    state = {key: rows[:-1]}  # the old table: max(L) + 1 rows
    without_layer_0.decoder.output_fusion.upgrade_state_dict_named(state, "decoder.output_fusion")
    torch.testing.assert_close(state[key], rows[1:-1])


# ----------------------------------------------------------------------------- decoding


@pytest.mark.parametrize("function", ["avg", "fnn", "sa"])
def test_decoder_fusion_is_causal(function):
    dictionary = toy_dictionary()
    model = build_model("slot_transformer", *fusion("none", function), dictionary=dictionary).eval()
    src, lengths, prev = random_batch(dictionary)
    changed = prev.clone()
    changed[:, 3:] = prev[:, 3:].flip(0)  # other tokens from position 3 on (rows differ)
    with torch.no_grad():
        before, after = model(src, lengths, prev)[0], model(src, lengths, changed)[0]
    torch.testing.assert_close(after[:, :3], before[:, :3])
    assert not torch.allclose(after[:, 3:], before[:, 3:])


@pytest.mark.parametrize(
    "options",
    [fusion("none", "avg"), fusion("none", "fnn"), fusion("none", "sa", "--mlrf-indep-w1"),
     fusion("avg", "sa"), fusion("fnn", "sa"), fusion("sa", "fnn", "--mlrf-no-embedding-layer")],
    ids=["Dec-AVG", "Dec-FNN", "Dec-SA indep W1", "Both-AVG-SA", "Both-FNN-SA", "Both-SA-FNN no word emb"],
)
@pytest.mark.parametrize("norm", [[], PRE_NORM], ids=["post-norm", "pre-norm"])
def test_incremental_decoding_matches_full_forward(options, norm):
    dictionary = toy_dictionary()
    model = build_model("slot_transformer", *options, *norm, dictionary=dictionary)
    assert_incremental_matches_full(model, dictionary)


@pytest.mark.parametrize("norm", [[], PRE_NORM], ids=["post-norm", "pre-norm"])
def test_encoder_fusion_at_generation_uses_every_layer(norm):
    """fairseq's generator calls the encoder without return_all_hiddens: the memory is still
    the fusion of [embedding, layer 1..L], the top one being fairseq's encoder output."""
    dictionary = toy_dictionary()
    model = build_model("slot_transformer", *fusion("avg", "none", "--mlrf-no-avg-layernorm"), *norm,
                        dictionary=dictionary).eval()
    src, lengths, _ = random_batch(dictionary)
    with torch.no_grad():
        memory = model.encoder.forward_torchscript({"src_tokens": src, "src_lengths": lengths})
        states = model.encoder.forward_scriptable(src, lengths, return_all_hiddens=True)
    assert memory["encoder_states"] == []
    expected = torch.stack(states["encoder_states"][:-1] + states["encoder_out"]).mean(0)
    torch.testing.assert_close(memory["encoder_out"][0], expected)
    assert len(states["encoder_states"]) == ENCODER_LAYERS + 1


# ----------------------------------------------------------------------------- configurations


@pytest.mark.parametrize(
    "options, message",
    [
        (fusion("sa", "none", "--mlrf-hops", "0"), "--mlrf-hops 0 must be >= 1"),
        (fusion("sa", "none", "--mlrf-attention-dim", "0"), "--mlrf-attention-dim 0 must be >= 1"),
        (fusion("none", "fnn", "--mlrf-ffn-dim", "-1"), "--mlrf-ffn-dim -1 must be >= 1"),
        (fusion("fnn", "avg", "--mlrf-indep-w1"), "--mlrf-indep-w1 needs SA fusion"),
        (fusion("fnn", "none", "--mlrf-fusion-dropout", "1.0"),
         r"--mlrf-fusion-dropout 1.0 must be in \[0, 1\)"),
        (fusion("fnn", "sa", "--decoder-embed-dim", "8", "--decoder-attention-heads", "2"),
         "--encoder-embed-dim == --decoder-embed-dim"),
        (fusion("sa") + ["--layer-aggregation", "s-agg"],
         r"'encoder_out' is written by several mechanisms \(--layer-aggregation s-agg, --mlrf-encoder-fusion sa\)"),
    ],
)
def test_bad_configurations_are_refused_with_a_clear_message(options, message):
    with pytest.raises(ValueError, match=message):
        build_model("slot_transformer", *options)


def test_command_line_options_reach_the_sa_fusion():
    """--mlrf-hops, --mlrf-attention-dim and --mlrf-ffn-dim at their smallest value 1, the
    activations (sigma of Eq. 5 and the FNN's) and the fusion dropout as given: Wang et al.
    2018, Eqs. 4-7 with ``e^l = W2 relu(W1 z~^l)`` and ``LN(W_b tanh(W_a s~ + b_a) + b_b)``."""
    torch.manual_seed(0)
    model = build_model("slot_transformer", "--mlrf-decoder-fusion", "sa", "--mlrf-hops", "1",
                        "--mlrf-attention-dim", "1", "--mlrf-ffn-dim", "1", "--mlrf-attention-activation",
                        "relu", "--mlrf-ffn-activation", "tanh", "--mlrf-fusion-dropout", "0.25")
    output = model.decoder.output_fusion.double().eval()
    sa = output.fusion
    assert sa.ffn.dropout_module.p == 0.25
    assert sa.attention.w1.weight.shape == (1, D) and sa.attention.w2.weight.shape == (1, 1)
    assert sa.ffn.fc1.weight.shape == (1, D)  # n_hop * C -> d_f
    states = stacked_states(DECODER_LAYERS + 1).double()
    z = states + output.layer_embedding.weight[:, None, None, :]  # Eq. 4
    energies = torch.relu(z @ sa.attention.w1.weight.T) @ sa.attention.w2.weight.T  # K x T x B x 1
    hop = (torch.softmax(energies, dim=0) * z).sum(0)  # Eqs. 6-7, one hop
    hidden = torch.tanh(hop @ sa.ffn.fc1.weight.T + sa.ffn.fc1.bias)
    expected = F.layer_norm(hidden @ sa.ffn.fc2.weight.T + sa.ffn.fc2.bias, (D,), sa.layer_norm.weight,
                            sa.layer_norm.bias)
    with torch.no_grad():
        # the hop weights are computed in fp32, as fairseq's attention
        torch.testing.assert_close(output(list(states)), expected, atol=1e-6, rtol=1e-5)


def test_unknown_fusion_function_is_refused_by_the_command_line(data_bin, tmp_path):
    result = run_fairseq("train", *train_args(data_bin, tmp_path, "slot_transformer",
                                              "--mlrf-decoder-fusion", "max"), check=False)
    assert result.returncode == 2
    assert "argument --mlrf-decoder-fusion: invalid choice: 'max'" in result.stderr


@pytest.mark.parametrize("side", ["encoder", "decoder"])
def test_unknown_fusion_function_of_stored_arguments_is_refused_in_one_line(side):
    """A checkpoint's arguments or --model-overrides reach the model without argparse's
    choices: the parsed options refuse the value, naming the option."""
    args = options.parse_args_and_arch(options.get_training_parser(), [
        "unused-data-dir", "--task", "translation", "--user-dir", USER_DIR, "--arch", "slot_transformer",
        *TINY_MODEL_ARGS])
    setattr(args, f"mlrf_{side}_fusion", "max")
    dictionary = toy_dictionary()
    task = tasks.translation.TranslationTask(args, dictionary, dictionary)
    with pytest.raises(UsageError) as refused:
        task.build_model(args)
    assert str(refused.value) == f"--mlrf-{side}-fusion max: choose one of none, avg, fnn, sa"


@pytest.mark.parametrize(
    "functions, text",
    [(("sa",), "SA fusion (--mlrf-encoder-fusion sa or --mlrf-decoder-fusion sa)"),
     (("fnn", "sa"), "FNN/SA fusion (--mlrf-encoder-fusion fnn|sa or --mlrf-decoder-fusion fnn|sa)"),
     (("avg", "fnn", "sa"),
      "AVG/FNN/SA fusion (--mlrf-encoder-fusion avg|fnn|sa or --mlrf-decoder-fusion avg|fnn|sa)")],
    ids=["SA", "FNN or SA", "any"],
)
def test_option_switches_name_their_functions_and_are_on_when_either_side_uses_one(functions, text):
    """The switch an MLRF option needs (e.g. --mlrf-hops: SA on the encoder or the decoder):
    its text for the set-while-off message, and its test of ``args``."""
    switch = _needs(*functions)
    assert switch.text == text
    for encoder, decoder in itertools.product(("none", "avg", "fnn", "sa"), repeat=2):
        args = argparse.Namespace(mlrf_encoder_fusion=encoder, mlrf_decoder_fusion=decoder)
        assert switch.is_on(args) is (encoder in functions or decoder in functions)
    # args without the MLRF options (or with None) are off
    assert switch.is_on(argparse.Namespace()) is False
    assert switch.is_on(argparse.Namespace(mlrf_encoder_fusion=None, mlrf_decoder_fusion="sa")) is True


def test_each_option_needs_the_functions_that_read_it():
    """The SA-only options need SA, those of the FNN (also inside SA) FNN or SA, the AVG
    LayerNorm AVG; MLRF itself is on with any function."""
    needs = {option.flag: option.needs.text for option in MLRF.options if option.needs is not None}
    sa, fnn_or_sa, avg = (_needs(*f).text for f in (("sa",), ("fnn", "sa"), ("avg",)))
    assert needs == {
        "--mlrf-hops": sa, "--mlrf-attention-dim": sa, "--mlrf-indep-w1": sa,
        "--mlrf-attention-activation": sa, "--mlrf-attention-bias": sa,
        "--mlrf-ffn-dim": fnn_or_sa, "--mlrf-no-layer-embedding": fnn_or_sa,
        "--mlrf-ffn-activation": fnn_or_sa, "--mlrf-fusion-dropout": fnn_or_sa,
        "--mlrf-no-avg-layernorm": avg,
    }
    assert MLRF.switch.text == _needs("avg", "fnn", "sa").text


# ----------------------------------------------------------------------------- command line


@pytest.mark.parametrize(
    "encoder, decoder",
    [("avg", "sa"), ("fnn", "avg"), ("sa", "fnn"), ("sa", "none"), ("none", "fnn")],
    ids=["Both-AVG-SA", "Both-FNN-AVG", "Both-SA-FNN", "Enc-SA", "Dec-FNN"],
)
def test_train_generate_round_trip(encoder, decoder, data_bin, tmp_path):
    """Every function on each side, one-sided and both; the presets (Both-FNN-SA, Dec-SA
    with independent W1) run in tests/test_cli_roundtrip.py."""
    assert_round_trip(data_bin, tmp_path, "slot_transformer", *fusion(encoder, decoder))


def adam_state(checkpoint):
    state = torch.load(checkpoint, weights_only=True)
    optimizer = state["last_optimizer_state"]
    steps = {param["step"] for param in optimizer["state"].values()}
    return state, steps, optimizer["param_groups"][0]["lr"]


def test_restart_adam_second_phase_starts_with_fresh_moments(data_bin, tmp_path):
    """Paper §4.2: 1 epoch with inverse_sqrt, then the Adam restart for 1 more epoch at a
    fixed lr (the README's recipe flags). Fresh moments: phase 2's Adam step count is
    phase 2's updates only (a resumed optimizer would count phase 1's too)."""
    phase1, phase2 = tmp_path / "phase1", tmp_path / "phase2"
    run_fairseq("train", *train_args(data_bin, phase1, "mlrf_transformer_iwslt_de_en", "--max-epoch", "1",
                                     "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "4",
                                     max_update=1000))
    restart = ["--restore-file", phase1 / "checkpoint_last.pt", "--reset-optimizer",
               "--reset-lr-scheduler", "--reset-meters", "--lr-scheduler", "fixed", "--lr", "5e-5",
               "--batch-size", "32", "--max-epoch", "2"]
    result = run_fairseq("train", *train_args(data_bin, phase2, "mlrf_transformer_iwslt_de_en", *restart,
                                              max_update=1000))
    log = result.stdout + result.stderr
    assert re.search(r"Loaded checkpoint \S+phase1/checkpoint_last.pt \(epoch 2 @ 0 updates\)", log)
    assert "begin training epoch 2" in log and "begin training epoch 1" not in log
    first, first_steps, _ = adam_state(phase1 / "checkpoint_last.pt")
    second, second_steps, lr = adam_state(phase2 / "checkpoint_last.pt")
    updates1 = first["optimizer_history"][-1]["num_updates"]
    updates2 = second["optimizer_history"][-1]["num_updates"]
    assert first_steps == {updates1} and updates1 > 0
    assert second_steps == {updates2} and updates2 > 0
    # the epoch count goes on (the iterator stores the next epoch)
    epochs = [state["extra_state"]["train_iterator"]["epoch"] for state in (first, second)]
    assert epochs[1] == epochs[0] + 1
    assert lr == pytest.approx(5e-5)


# ----------------------------------------------------------------------------- Figure 5 data


def hop_weight_checkpoint(tmp_path, decoder_function, encoder_function="none"):
    data_dir = write_data_bin(tmp_path / "bin")
    cfg, _, model = build_task_and_model(str(data_dir), extra_args=[
        "--arch", "slot_transformer", *fusion(encoder_function, decoder_function)])
    return data_dir, save_checkpoint(tmp_path / "model.pt", cfg, model)


def test_hop_weight_analysis_writes_data_and_heat_maps(tmp_path):
    data_dir, checkpoint = hop_weight_checkpoint(tmp_path, "sa")
    (tmp_path / "src.txt").write_text("w1 w2 w3\nw4 w5\nw6\n")
    (tmp_path / "tgt.txt").write_text("w3 w2 w1\nw5 w4 w9 w8\nw6\n")
    prefix = str(tmp_path / "out" / "hops")
    mlrf_hop_weights.main([str(checkpoint), "--data-bin", str(data_dir),
                           "--source", str(tmp_path / "src.txt"), "--target", str(tmp_path / "tgt.txt"),
                           "--lines", "2", "3", "--plots", "1", "--output-prefix", prefix])
    result = json.loads(open(prefix + ".json").read())
    assert result["layers"] == ["l0", "l1", "l2"] and result["hops"] == HOPS
    second = result["sentences"][0]
    assert second["line"] == 2 and second["positions"] == ["</s>", "w5", "w4", "w9", "w8"]
    weights = torch.tensor(second["weights"])  # n_hop x K x T
    assert weights.shape == (HOPS, DECODER_LAYERS + 1, 5)
    torch.testing.assert_close(weights.sum(1), torch.ones(HOPS, 5))
    rows = open(prefix + ".csv").read().splitlines()
    assert len(rows) == 1 + (5 + 2) * HOPS * (DECODER_LAYERS + 1)
    assert (tmp_path / "out" / "hops_line2.png").stat().st_size > 0
    assert not (tmp_path / "out" / "hops_line3.png").exists()


def test_hop_weight_analysis_reads_the_encoder_side_of_an_enc_sa_model(tmp_path):
    data_dir, checkpoint = hop_weight_checkpoint(tmp_path, "none", encoder_function="sa")
    (tmp_path / "src.txt").write_text("w1 w2 w3\n")
    (tmp_path / "tgt.txt").write_text("w3 w2 w1\n")
    prefix = str(tmp_path / "out" / "hops")
    mlrf_hop_weights.main([str(checkpoint), "--data-bin", str(data_dir), "--side", "encoder", "--source",
                           str(tmp_path / "src.txt"), "--target", str(tmp_path / "tgt.txt"), "--plots", "0",
                           "--output-prefix", prefix])
    result = json.loads(open(prefix + ".json").read())
    weights = torch.tensor(result["sentences"][0]["weights"])  # n_hop x K x source positions (EOS included)
    encoder_layers = 2  # hop_weight_checkpoint's model: tests/fixtures/tiny_fairseq.py
    assert result["layers"] == ["l0", "l1", "l2"] and weights.shape == (HOPS, encoder_layers + 1, 4)
    torch.testing.assert_close(weights.sum(1), torch.ones(HOPS, 4))


def test_hop_weights_over_training_are_each_checkpoints_means_in_update_order(tmp_path, capsys):
    """Several checkpoints: each one's mean weights (as the one-checkpoint analysis gives them),
    ordered by the updates stored in the checkpoints, not by the order given."""
    data_dir = write_data_bin(tmp_path / "bin")
    checkpoints = {}
    for seed, updates in ((1, 70), (2, 30)):
        cfg, _, model = build_task_and_model(str(data_dir), seed=seed, extra_args=[
            "--arch", "slot_transformer", *fusion("none", "sa")])
        checkpoints[updates] = save_checkpoint(tmp_path / f"checkpoint_1_{updates}.pt", cfg, model, updates)
    (tmp_path / "src.txt").write_text("w1 w2 w3\nw4 w5\n")
    (tmp_path / "tgt.txt").write_text("w3 w2 w1\nw5 w4 w9\n")
    text = ["--data-bin", str(data_dir), "--source", str(tmp_path / "src.txt"), "--target", str(tmp_path / "tgt.txt")]
    single = {}
    for updates, checkpoint in checkpoints.items():
        mlrf_hop_weights.main([str(checkpoint), *text, "--plots", "0", "--output-prefix", str(tmp_path / f"one{updates}")])
        single[updates] = json.loads((tmp_path / f"one{updates}.json").read_text())["mean_weights"]
    assert single[30] != single[70]
    capsys.readouterr()
    prefix = tmp_path / "over" / "training"
    mlrf_hop_weights.main([str(checkpoints[70]), str(checkpoints[30]), *text, "--output-prefix", str(prefix)])
    result = json.loads(prefix.with_suffix(".json").read_text())
    assert result["layers"] == ["l0", "l1", "l2"] and result["sentences"] == 2
    assert [point["updates"] for point in result["checkpoints"]] == [30, 70]
    for point in result["checkpoints"]:
        torch.testing.assert_close(torch.tensor(point["mean_weights"]), torch.tensor(single[point["updates"]]))
    rows = prefix.with_suffix(".csv").read_text().splitlines()
    assert len(rows) == 1 + 2 * HOPS * (DECODER_LAYERS + 1)
    assert prefix.with_suffix(".png").stat().st_size > 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[1] == "update 30: " + " ".join(
        f"{w:.3f}" for w in torch.tensor(single[30]).mean(0).tolist())


def test_hop_weights_over_training_refuses_checkpoints_of_different_models(tmp_path, capsys):
    data_dir = write_data_bin(tmp_path / "bin")
    paths = []
    for layers in (2, 1):
        cfg, _, model = build_task_and_model(str(data_dir), extra_args=[
            "--arch", "slot_transformer", "--decoder-layers", str(layers), *fusion("none", "sa")])
        paths.append(str(save_checkpoint(tmp_path / f"model{layers}.pt", cfg, model)))
    (tmp_path / "src.txt").write_text("w1 w2\n")
    (tmp_path / "tgt.txt").write_text("w2 w1\n")
    with pytest.raises(SystemExit) as exit_info:
        mlrf_hop_weights.main([*paths, "--data-bin", str(data_dir), "--source", str(tmp_path / "src.txt"),
                               "--target", str(tmp_path / "tgt.txt"), "--output-prefix", str(tmp_path / "x")])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]  # after fairseq's log lines
    assert "model1.pt fuses layers l0 l1, the others l0 l1 l2: give checkpoints of one model" in error
    assert not (tmp_path / "x.json").exists()


def test_hop_weight_analysis_needs_an_sa_fusion(tmp_path, capsys):
    data_dir, checkpoint = hop_weight_checkpoint(tmp_path, "fnn")
    with pytest.raises(SystemExit) as exit_info:
        mlrf_hop_weights.main([str(checkpoint), "--data-bin", str(data_dir), "--split", "test"])
    assert exit_info.value.code == 2
    assert "no SA fusion on the decoder side" in capsys.readouterr().err
