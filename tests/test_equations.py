"""Each mechanism inside a whole model, against its paper's equations written out here in
plain torch (on the reference Transformer of ``reference_transformer.py``).

The models are built by fairseq's parser; the reference reads their weights by parameter
name and recomputes the logits (or encoder output) from the token ids, so a mechanism in
the wrong place of the layer, with swapped roles, or missing a LayerNorm gives different
numbers. Every case runs with the source padded on the left (fairseq's default) and on the
right, and in post-norm (the papers' equations) and pre-norm where the mechanism has both.
"""
import pytest
import torch

import reference_transformer as ref
from fairseq_helpers import NORMS, build_model, random_batch

ENCODER_LAYERS, DECODER_LAYERS, HEADS = 3, 2, 2  # TINY_MODEL_ARGS
PADDING = pytest.mark.parametrize("left_pad", [True, False], ids=["left-pad", "right-pad"])
ATOL = 1e-6


def model_and_batch(arch, *options, left_pad=True):
    """The model with every parameter moved off its initial value (LayerNorm gains away from
    1, zero-initialised biases and mixture weights away from 0), so that no sublayer is an
    identity the reference could get away without; a token batch; the weights by name.
    In float64, so that the summation order (which depends on the thread count) no longer
    matters: in float32 it moved single logits by up to 3e-5. fairseq's attention still
    takes its softmax in float32, which bounds the agreement at about 3e-7."""
    with torch.random.fork_rng():
        # the same initial weights whatever ran before in this process: a tolerance is then
        # checked on one model, not on whichever one the test order draws
        torch.manual_seed(0)
        model = build_model(arch, *options).double().eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():  # each shared tensor once
            parameter.add_(0.3 * torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))
    dictionary = model.decoder.dictionary
    src, lengths, prev = random_batch(dictionary, batch_size=4, src_len=7, tgt_len=6, left_pad=left_pad)
    params = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    return model, params, src, lengths, prev, dictionary.pad()


def model_logits(model, src, lengths, prev):
    with torch.no_grad():
        return model(src, lengths, prev)[0]


def reference_encoder(params, src, pad, norm, self_attention=None):
    return ref.encoder(src, params, HEADS, ENCODER_LAYERS, bool(norm), pad, self_attention)


def reference_logits(params, src, prev, pad, norm, memories=None):
    """The standard decoder on the top encoder layer (or on ``memories``, one per layer)."""
    _, out, mask = reference_encoder(params, src, pad, norm)
    memories = memories or [out] * DECODER_LAYERS
    states = ref.decoder_states(prev, memories, mask, params, "decoder", HEADS, bool(norm), pad)
    return ref.decoder_output(states[-1], params, "decoder", bool(norm))


@NORMS
@PADDING
def test_the_reference_is_the_slot_transformer(norm, left_pad):
    """The reference itself, on the model with every mechanism off."""
    model, params, src, lengths, prev, pad = model_and_batch("slot_transformer", *norm, left_pad=left_pad)
    expected = reference_logits(params, src, prev, pad, norm)
    torch.testing.assert_close(model_logits(model, src, lengths, prev), expected, atol=ATOL, rtol=1e-5)


# --- AIF: thesis Eqs. 4.2-4.3 ------------------------------------------------------------

@NORMS
@PADDING
def test_aif_adds_the_fused_auxiliary_states_right_after_the_masked_self_attention(norm, left_pad):
    """MS-12 + AIF. Aux-Decoder l is a standard decoder on ``H_e^l`` (pre-norm: through its
    own LayerNorm); its final hidden states ``f^i`` (after its final LayerNorm in pre-norm)
    enter every Main-Decoder layer as ``z^f_l = sum_i f^i W_l^{a_i}`` (Eq. 4.2), added to
    ``S_d^l`` (post-norm) or to the residual stream (pre-norm) right after the masked
    self-attention and before the cross-attention (Eq. 4.3)."""
    aux_layers = [1, 2]
    model, params, src, lengths, prev, pad = model_and_batch(
        "ms_transformer", "--aux-decoder-layers", "1,2", "--aux-fusion", *norm, left_pad=left_pad)
    pre_norm = bool(norm)
    states, out, mask = reference_encoder(params, src, pad, norm)
    features = []
    for i, layer in enumerate(aux_layers):
        memory = states[layer]
        if pre_norm:
            memory = ref.layer_norm(memory, params, f"encoder.memories.aux_memories.aux_layer_norms.{i}")
        prefix = f"decoder.aux_decoders.{i}"
        top = ref.decoder_states(prev, [memory] * DECODER_LAYERS, mask, params, prefix, HEADS, pre_norm, pad)[-1]
        features.append(ref.layer_norm(top, params, f"{prefix}.layer_norm") if pre_norm else top)
    dim = out.size(-1)
    fused = []
    for layer in range(DECODER_LAYERS):
        # the n matrices W_l^{a_i} (C_in x C_out) side by side in one Linear(n d -> d)
        matrices = params[f"decoder.layers.{layer}.aux_fusion.proj.weight"].t().split(dim, dim=0)
        fused.append(sum(f @ w for f, w in zip(features, matrices)))
    expected = ref.decoder_output(
        ref.decoder_states(prev, [out] * DECODER_LAYERS, mask, params, "decoder", HEADS, pre_norm, pad, fused)[-1],
        params, "decoder", pre_norm)
    torch.testing.assert_close(model_logits(model, src, lengths, prev), expected, atol=ATOL, rtol=1e-5)
    # the fused term matters: the same model without it is another function
    without = reference_logits(params, src, prev, pad, norm)
    assert (without - expected).abs().max() > 1e-2


# --- Dual Contextual module: thesis Eqs. 5.4-5.7 -------------------------------------------

def dual_contextual(heads, kernel_size, causal):
    """The DC module as a self-attention sublayer (Fig. 5.2), returning ``z_hat``; the layer
    adds the residual and LayerNorm of Eq. 5.7 (post-norm) or the pre-norm residual."""
    before = kernel_size - 1 if causal else (kernel_size - 1) // 2

    def module(r, params, name, padding_mask):
        keep = 1.0 if padding_mask is None else (~padding_mask)[..., None].float()
        inputs = r * keep  # pad rows are zeros in the window
        weight, bias = params[f"{name}.local_unit.conv.weight"], params[f"{name}.local_unit.conv.bias"]
        length = r.size(1)
        projected = bias.expand(*r.shape[:2], -1).clone()  # [r_{t-a}; ...; r_{t+b}] W^r + b^r
        for k in range(kernel_size):
            offset = k - before
            for t in range(length):
                if 0 <= t + offset < length:
                    projected[:, t] += inputs[:, t + offset] @ weight[:, :, k].t()
        a, b = projected.chunk(2, dim=-1)
        r_hat = a * torch.sigmoid(b)  # GLU (Eq. 5.4)
        local = ref.layer_norm(r_hat + r, params, f"{name}.local_unit.layer_norm") * keep  # l_c
        # Eqs. 5.5-5.6: h_l = FI(r, l_c): queries from r, keys and values from l_c; h_g = FI(r, r).
        # Each FI's bias-free out_proj is its row block of W_z (Eq. 5.7: [h_l; h_g] W_z + b_z).
        h_local = ref.attention(r, local, params, f"{name}.local_interaction", heads, padding_mask, causal)
        h_global = ref.attention(r, r, params, f"{name}.global_interaction", heads, padding_mask, causal)
        return h_local + h_global + params[f"{name}.merge_bias"]

    return module


@NORMS
@PADDING
@pytest.mark.parametrize("kernel_size", [2, 3])
def test_dual_contextual_encoder_and_causal_decoder_follow_eqs_5_4_to_5_7(norm, left_pad, kernel_size):
    """Full-DC: every encoder layer's self-attention is the DC module with a centred window
    (f=2: [t, t+1]; f=3: [t-1, t+1]), every decoder layer's the causal one ([t-f+1, t])."""
    model, params, src, lengths, prev, pad = model_and_batch(
        "slot_transformer", "--dc-encoder-layers", "all", "--dc-decoder-layers", "all",
        "--dc-kernel-size", kernel_size, *norm, left_pad=left_pad)
    pre_norm = bool(norm)
    states, out, mask = reference_encoder(
        params, src, pad, norm, self_attention=lambda _: dual_contextual(HEADS, kernel_size, causal=False))
    with torch.no_grad():
        encoder_out = model.encoder(src, src_lengths=lengths)
    real = (~mask).transpose(0, 1)  # T x B
    torch.testing.assert_close(encoder_out["encoder_out"][0][real], out.transpose(0, 1)[real],
                               atol=ATOL, rtol=1e-5)
    decoder_states = ref.decoder_states(
        prev, [out] * DECODER_LAYERS, mask, params, "decoder", HEADS, pre_norm, pad,
        self_attention=lambda _: dual_contextual(HEADS, kernel_size, causal=True))
    expected = ref.decoder_output(decoder_states[-1], params, "decoder", pre_norm)
    torch.testing.assert_close(model_logits(model, src, lengths, prev), expected, atol=ATOL, rtol=1e-5)


# --- MLRF: Wang et al. 2018, Eqs. 3-7 ------------------------------------------------------

def mlrf_sizes(function):
    """Small sizes for the options ``function`` uses (an option of a fusion that is off is refused)."""
    return {"avg": [], "fnn": ["--mlrf-ffn-dim", "12"],
            "sa": ["--mlrf-hops", "2", "--mlrf-attention-dim", "8", "--mlrf-ffn-dim", "12"]}[function]


def fuse_layers(states, params, name, function):
    """``phi(Z_j)`` then its LayerNorm over ``states`` = [layer 0 (embedding), 1..L], each
    B x T x C. AVG: the mean (§3.2); FNN: an FNN over the layer-major concatenation of
    ``z~^l = z^l + E_l`` (Eq. 4); SA: hop weights ``a_p^l = softmax_l(W2 tanh(W1 z~^l))``
    (Eqs. 5-6), ``s_p = sum_l a_p^l z~^l`` (Eq. 7), an FNN over ``[s_1; ...; s_n_hop]``."""
    if function == "avg":
        return ref.layer_norm(torch.stack(states).mean(0), params, f"{name}.fusion.layer_norm")
    rows = params[f"{name}.layer_embedding.weight"]
    tilde = [z + rows[l] for l, z in enumerate(states)]
    if function == "fnn":
        flat = torch.cat(tilde, dim=-1)
    else:
        energies = [ref.linear(torch.tanh(ref.linear(z, params, f"{name}.fusion.attention.w1")),
                               params, f"{name}.fusion.attention.w2") for z in tilde]  # B x T x n_hop each
        weights = torch.softmax(torch.stack(energies), dim=0)  # over the layers
        hops = [sum(weights[l, ..., p, None] * tilde[l] for l in range(len(tilde)))
                for p in range(weights.size(-1))]
        flat = torch.cat(hops, dim=-1)
    hidden = torch.relu(ref.linear(flat, params, f"{name}.fusion.ffn.fc1"))
    return ref.layer_norm(ref.linear(hidden, params, f"{name}.fusion.ffn.fc2"), params, f"{name}.fusion.layer_norm")


@NORMS
@PADDING
@pytest.mark.parametrize("function", ["avg", "fnn", "sa"])
def test_decoder_side_mlrf_replaces_the_top_layer_before_the_final_layer_norm(norm, left_pad, function):
    """Dec-*: ``z^_j = phi(Z_j)`` over the decoder's embedding output and layer outputs
    replaces the top layer as the input of the output projection (Eq. 3); in pre-norm the
    decoder's final LayerNorm then normalises the fused vector, as it would the top layer."""
    model, params, src, lengths, prev, pad = model_and_batch(
        "slot_transformer", "--mlrf-decoder-fusion", function, *mlrf_sizes(function), *norm, left_pad=left_pad)
    pre_norm = bool(norm)
    _, out, mask = reference_encoder(params, src, pad, norm)
    states = ref.decoder_states(prev, [out] * DECODER_LAYERS, mask, params, "decoder", HEADS, pre_norm, pad)
    fused = fuse_layers(states, params, "decoder.output_fusion", function)
    expected = ref.decoder_output(fused, params, "decoder", pre_norm)
    torch.testing.assert_close(model_logits(model, src, lengths, prev), expected, atol=ATOL, rtol=1e-5)


@NORMS
@PADDING
@pytest.mark.parametrize("function", ["avg", "fnn", "sa"])
def test_encoder_side_mlrf_is_the_memory_of_every_decoder_layer(norm, left_pad, function):
    """Enc-*: ``h^ = phi(H)`` over the encoder's embedding output and layers 1..L (the top
    one as the decoder sees it, after the final LayerNorm in pre-norm) is every decoder
    layer's cross-attention memory."""
    model, params, src, lengths, prev, pad = model_and_batch(
        "slot_transformer", "--mlrf-encoder-fusion", function, *mlrf_sizes(function), *norm, left_pad=left_pad)
    states, out, _ = reference_encoder(params, src, pad, norm)
    memory = fuse_layers(states[:-1] + [out], params, "encoder.memories.mlrf_fusion", function)
    expected = reference_logits(params, src, prev, pad, norm, memories=[memory] * DECODER_LAYERS)
    torch.testing.assert_close(model_logits(model, src, lengths, prev), expected, atol=ATOL, rtol=1e-5)


# --- Layer aggregation: thesis Eqs. 3.1-3.5; Transparent Attention (Bapna et al. 2018) -----

AGGREGATION = "encoder.memories.layer_aggregation"


def source_taps(states, out, params, pre_norm, top_n):
    """Source Feature Collector: ``f^i = H_e^{L-n+i}``, bottom to top, ``f^n`` the encoder
    output; in pre-norm the lower ones pass through their own LayerNorm."""
    lower = states[ENCODER_LAYERS - top_n + 1:ENCODER_LAYERS]
    if pre_norm:
        lower = [ref.layer_norm(f, params, f"{AGGREGATION}.collector.layer_norms.{i}") for i, f in enumerate(lower)]
    return lower + [out]


def weighted_sum(inputs, weight):
    """WS (Eq. 3.1): ``sum_i r_i W^i``, ``weight[i]`` stored out x in."""
    return sum(r @ w.t() for r, w in zip(inputs, weight))


def aggregate(inputs, params, name):
    """AGG (Eq. 3.3): ``LN(FFN(Concat(r_1..r_b)) + sum_i r_i)``, ReLU FFN."""
    hidden = torch.relu(ref.linear(torch.cat(inputs, dim=-1), params, f"{name}.fc1"))
    return ref.layer_norm(ref.linear(hidden, params, f"{name}.fc2") + sum(inputs), params, f"{name}.layer_norm")


def joint_memory(name, taps, params):
    unit = f"{AGGREGATION}.aggregation"
    if name == "s-agg":  # Fig. 3.2a
        return weighted_sum(taps, params[f"{unit}.weight"])
    if name == "c-agg":  # Eq. 3.4
        return aggregate(taps, params, unit)
    # Eqs. 3.2 / 3.5: H_1 = f^1, H_i = U_i(H_{i-1}, f^i), one unshared unit per step; the
    # inputs are ordered [H_{i-1}; f^i] (the authors' code; the thesis writes [f^i, H_{i-1}])
    memory = taps[0]
    for i, tap in enumerate(taps[1:]):
        step = f"{unit}.units.{i}"
        if name == "iter-s-agg":
            memory = weighted_sum([memory, tap], params[f"{step}.weight"])
        else:
            memory = aggregate([memory, tap], params, step)
    return memory


@NORMS
@PADDING
@pytest.mark.parametrize("name", ["s-agg", "iter-s-agg", "c-agg", "iter-c-agg"])
@pytest.mark.parametrize("top_n", [3, 2])
def test_layer_aggregation_is_the_memory_of_every_decoder_layer(norm, left_pad, name, top_n):
    model, params, src, lengths, prev, pad = model_and_batch(
        "slot_transformer", "--layer-aggregation", name, "--mlmha-top-n", top_n, *norm, left_pad=left_pad)
    states, out, _ = reference_encoder(params, src, pad, norm)
    memory = joint_memory(name, source_taps(states, out, params, bool(norm), top_n), params)
    expected = reference_logits(params, src, prev, pad, norm, memories=[memory] * DECODER_LAYERS)
    torch.testing.assert_close(model_logits(model, src, lengths, prev), expected, atol=ATOL, rtol=1e-5)


@NORMS
@PADDING
def test_transparent_attention_gives_each_decoder_layer_its_own_mixture(norm, left_pad):
    """Decoder layer j attends to ``sum_i softmax_i(W_ij) H_e^i`` over the embedding output
    and layers 1..L (Bapna et al. 2018, Eq. 1)."""
    model, params, src, lengths, prev, pad = model_and_batch(
        "slot_transformer", "--layer-aggregation", "transparent", *norm, left_pad=left_pad)
    scalars = params["encoder.memories.transparent_attention.combination.weight"]  # (L+1) x M
    states, out, _ = reference_encoder(params, src, pad, norm)
    states = states[:-1] + [out]
    memories = [sum(w * h for w, h in zip(torch.softmax(scalars[:, j], dim=0), states))
                for j in range(DECODER_LAYERS)]
    expected = reference_logits(params, src, prev, pad, norm, memories=memories)
    torch.testing.assert_close(model_logits(model, src, lengths, prev), expected, atol=ATOL, rtol=1e-5)


# --- DLCL: Wang et al. 2019, §3 -------------------------------------------------------------

DLCL = "encoder.layer_inputs"


def dlcl_encoder(params, src, pad, pre_norm):
    """The encoder with DLCL, from the paper: layer l+1 reads ``x_{l+1} = G(y_0, ..., y_l)``
    (§3), ``sum_k W_{l+1,k} LN(y_k)`` in pre-norm, ``LN(sum_k W_{l+1,k} y_k)`` in
    post-norm; the encoder output is row L+1 over ``y_0..y_L`` (then the final LayerNorm
    in pre-norm). The authors' code: ``y_0`` is never normalised, and the first layer's input in
    post-norm is ``W_{1,0} y_0`` without a LayerNorm. Returns ``(out, padding_mask)``."""
    padding_mask = src.eq(pad)
    outputs = [ref.embed(src, params, "encoder.embed_tokens", pad) * (~padding_mask)[..., None]]  # y_0

    def layer_norm(k, x):  # the k-th LayerNorm of the combination, k = 1..L
        return ref.layer_norm(x, params, f"{DLCL}.layer_norms.{k - 1}")

    def combination(l):  # x_{l+1} from y_0..y_l, row l+1 of W
        w = params[f"{DLCL}.weights.{l}"]
        if pre_norm:
            return sum(w[k] * (layer_norm(k, y) if k > 0 else y) for k, y in enumerate(outputs))
        summed = sum(w[k] * y for k, y in enumerate(outputs))
        return layer_norm(l, summed) if l > 0 else summed

    attend = ref.standard_self_attention(HEADS, causal=False)
    for i in range(ENCODER_LAYERS):
        name = f"encoder.layers.{i}"
        x = ref.sublayer(combination(i), params, f"{name}.self_attn_layer_norm", pre_norm,
                         lambda r: attend(r, params, f"{name}.self_attn", padding_mask))
        outputs.append(ref.sublayer(x, params, f"{name}.final_layer_norm", pre_norm,
                                    lambda h: ref.ffn(h, params, name)))
    out = combination(ENCODER_LAYERS)
    return (ref.layer_norm(out, params, "encoder.layer_norm") if pre_norm else out), padding_mask


@NORMS
@PADDING
def test_dlcl_encoder_layers_read_the_dynamic_linear_combination_of_all_layers_below(norm, left_pad):
    model, params, src, lengths, prev, pad = model_and_batch("slot_transformer", "--dlcl-encoder", *norm,
                                                             left_pad=left_pad)
    pre_norm = bool(norm)
    out, mask = dlcl_encoder(params, src, pad, pre_norm)
    with torch.no_grad():
        encoder_out = model.encoder(src, src_lengths=lengths)
    real = (~mask).transpose(0, 1)  # T x B
    torch.testing.assert_close(encoder_out["encoder_out"][0][real], out.transpose(0, 1)[real], atol=ATOL, rtol=1e-5)
    states = ref.decoder_states(prev, [out] * DECODER_LAYERS, mask, params, "decoder", HEADS, pre_norm, pad)
    expected = ref.decoder_output(states[-1], params, "decoder", pre_norm)
    torch.testing.assert_close(model_logits(model, src, lengths, prev), expected, atol=ATOL, rtol=1e-5)
    # the combination matters: the plain encoder with the same weights is another function
    assert (reference_logits(params, src, prev, pad, norm) - expected).abs().max() > 1e-2
