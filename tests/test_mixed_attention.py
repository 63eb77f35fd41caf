"""Mixed Multi-Head Self-Attention (MMA) in the slot Transformer (Cui et al. 2019)."""
import json

import numpy as np
import pytest
import torch
from fairseq.modules import MultiheadAttention

from fairseq_helpers import NORMS, assert_round_trip, build_model, random_batch, toy_dictionary
from mlmha_fairseq.models.mma import default_head_types, parse_head_types
from mlmha_fairseq.modules.mixed_attention import MixedMultiheadAttention, allowed_keys, head_masks

D, HEADS = 16, 4
CPU = torch.device("cpu")

# Cui et al. 2019, Eqs. 8-11, T = 5, w = 1: 1 = allowed, rows are queries.
WORKED_EXAMPLE = {
    "L": ["11000", "11100", "01110", "00111", "00011"],
    "F": ["11111", "01111", "00111", "00011", "00001"],
    "B": ["10000", "11000", "11100", "11110", "11111"],
}


def mixed(*heads, window=None):
    options = ["--encoder-self-attention", "mixed", "--mma-heads", ",".join(heads)]
    return options + (["--mma-local-window", str(window)] if window is not None else [])


def num_params(model):
    return sum(p.numel() for p in model.parameters())


def attention_pair(heads, window=1, seed=0):
    """fairseq's self-attention and an MMA module with the same weights."""
    torch.manual_seed(seed)
    reference = MultiheadAttention(D, len(heads), self_attention=True)
    module = MixedMultiheadAttention(D, len(heads), heads, window)
    module.load_state_dict(reference.state_dict(), strict=True)
    return reference.eval(), module.eval()


def padded_input(left_pad, length=7, batch_size=3, dtype=torch.float32, seed=0):
    """T x B x C input and a B x T padding mask, sentence b shorter by 2b tokens."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(length, batch_size, D, generator=gen).to(dtype)
    pad = torch.zeros(batch_size, length, dtype=torch.bool)
    for b in range(batch_size):
        pads = slice(0, 2 * b) if left_pad else slice(length - 2 * b, length)
        pad[b, pads] = True
    return x, pad


def test_masks_equal_the_spec_worked_example():
    masks = head_masks(("G", "L", "F", "B"), 1, 5, CPU)
    assert masks.dtype == torch.bool and masks.shape == (4, 5, 5)
    assert masks[0].all()
    for head, name in enumerate("LFB", start=1):
        expected = torch.tensor([[int(c) for c in row] for row in WORKED_EXAMPLE[name]], dtype=torch.bool)
        assert torch.equal(masks[head], expected), name


def test_heads_are_assigned_in_order_and_masks_are_cached():
    head_masks.cache_clear()
    masks = head_masks(("B", "G", "F", "B"), 2, 6, CPU)
    assert torch.equal(masks[0], masks[3]) and masks[1].all() and torch.equal(masks[2], masks[0].T)
    assert head_masks(("B", "G", "F", "B"), 2, 6, CPU) is masks


def test_masks_are_built_once_per_length_for_all_layers():
    dictionary = toy_dictionary()
    model = build_model("slot_transformer", *mixed("F", "B")).eval()
    src, lengths, prev = random_batch(dictionary, src_len=9)
    head_masks.cache_clear()
    with torch.no_grad():
        for _ in range(2):
            model(src, lengths, prev)
    info = head_masks.cache_info()
    assert (info.misses, info.hits) == (1, 2 * 3 - 1)  # 3 encoder layers, 2 batches


@pytest.mark.parametrize("left_pad", [True, False], ids=["left-pad", "right-pad"])
@pytest.mark.parametrize("need_weights", [False, True, None], ids=["sdpa", "explicit", "default"])
def test_all_global_heads_equal_fairseq_self_attention(left_pad, need_weights):
    """Same outputs and weights as fairseq's attention; like it, weights by default (None: not
    given) and none when ``need_weights=False``."""
    reference, module = attention_pair("GGGG")
    x, pad = padded_input(left_pad)
    asked = {} if need_weights is None else {"need_weights": need_weights}
    expected, expected_weights = reference(x, x, x, key_padding_mask=pad, **asked)
    got, got_weights = module(x, x, x, key_padding_mask=pad, **asked)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
    assert (got_weights is None) == (need_weights is False) == (expected_weights is None)
    if expected_weights is not None:
        torch.testing.assert_close(got_weights, expected_weights, atol=1e-6, rtol=1e-5)


def test_attention_dropout_in_training_only():
    """fairseq's rule for attention-weight dropout, on both paths: active in training (or with
    fairseq's ``--retain-dropout``, ``apply_during_inference``), never in eval mode, where the
    output is fairseq's."""
    torch.manual_seed(0)
    reference = MultiheadAttention(D, HEADS, self_attention=True, dropout=0.5)
    module = MixedMultiheadAttention(D, HEADS, "GGGG", 1, dropout=0.5)
    module.load_state_dict(reference.state_dict(), strict=True)
    x, pad = padded_input(left_pad=True)
    reference.eval(), module.eval()
    with torch.no_grad():
        deterministic = reference(x, x, x, key_padding_mask=pad, need_weights=False)[0]
        for need_weights in (False, True):
            got = module(x, x, x, key_padding_mask=pad, need_weights=need_weights)[0]
            torch.testing.assert_close(got, deterministic, atol=1e-6, rtol=1e-5)
            module.train()
            assert not torch.allclose(module(x, x, x, key_padding_mask=pad, need_weights=need_weights)[0],
                                      deterministic), f"training, need_weights={need_weights}"
            module.eval()
            module.dropout_module.apply_during_inference = True
            assert not torch.allclose(module(x, x, x, key_padding_mask=pad, need_weights=need_weights)[0],
                                      deterministic), f"retained dropout, need_weights={need_weights}"
            module.dropout_module.apply_during_inference = False


def test_fairseq_constructor_arguments_reach_the_projections():
    """``MixedMultiheadAttention`` takes fairseq's constructor arguments: ``bias=False`` leaves
    the four d x d projections only, and ``dropout`` is the attention-weight dropout."""
    module = MixedMultiheadAttention(D, HEADS, "GLFB", 1, bias=False, dropout=0.2)
    assert num_params(module) == 4 * D * D
    assert module.dropout_module.p == 0.2


@pytest.mark.parametrize("sizes", [dict(kdim=D // 2), dict(vdim=D // 2)], ids=["kdim", "vdim"])
def test_is_a_fairseq_self_attention_and_refuses_other_key_value_sizes(sizes):
    """An encoder *self*-attention (Cui et al. 2019, Eq. 7: Q, K, V are the layer input):
    built as fairseq's self-attention (its ``self_attention`` flag set), whose own check
    refuses keys or values of another width than the queries at construction."""
    assert MixedMultiheadAttention(D, HEADS, "GLFB", 1).self_attention is True
    with pytest.raises(AssertionError, match="Self-attention requires query, key and value to be of the same size"):
        MixedMultiheadAttention(D, HEADS, "GLFB", 1, **sizes)


def test_every_tensor_follows_the_device_of_the_input():
    """The structural masks, the padding and the diagonal of fully masked rows are made on the
    query's device (checked on PyTorch's meta device, which refuses to mix with CPU tensors, so
    no GPU is needed)."""
    with torch.device("meta"):
        module = MixedMultiheadAttention(D, HEADS, "GLFB", 1).eval()
    x = torch.empty(7, 3, D, device="meta")
    pad = torch.zeros(3, 7, dtype=torch.bool, device="meta")
    head_masks.cache_clear()
    for need_weights in (False, True):
        for mask in (None, pad):
            out, weights = module(x, x, x, key_padding_mask=mask, need_weights=need_weights)
            assert out.is_meta and out.shape == x.shape
            assert weights is None or weights.is_meta


def test_local_window_zero_attends_to_itself_only():
    """Eq. 9 with w = 0: each query's one allowed key is itself, so the softmax is 1 and a local
    head's context is the value of its own position: ``MA = (x W^V + b^V) W^O + b^O``.
    Accepted as an option and by the module."""
    model = build_model("slot_transformer", *mixed("L", "L", window=0))
    attention = model.encoder.layers[0].self_attn.eval()
    assert attention.window == 0
    x, pad = padded_input(left_pad=True)
    v, out = attention.v_proj, attention.out_proj
    expected = (x @ v.weight.T + v.bias) @ out.weight.T + out.bias
    with torch.no_grad():
        for need_weights in (False, True):
            got = attention(x, x, x, key_padding_mask=pad, need_weights=need_weights)[0]
            torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("arguments, message", [
    (dict(head_types="GLF", window=1), r"3 head types \('G', 'L', 'F'\) for 4 heads"),
    (dict(head_types="GLFX", window=1), r"unknown head type\(s\) \['X'\]"),
    (dict(head_types="GLFB", window=-1), "local window -1"),
])
def test_module_refuses_bad_heads_and_windows(arguments, message):
    with pytest.raises(ValueError, match=message):
        MixedMultiheadAttention(D, HEADS, **arguments)


@pytest.mark.parametrize("unsupported", [
    dict(incremental_state={}), dict(static_kv=True), dict(before_softmax=True),
    dict(attn_mask=torch.zeros(7, 7)),
], ids=["incremental_state", "static_kv", "before_softmax", "attn_mask"])
def test_decoder_only_arguments_are_refused_each_alone(unsupported):
    """An encoder self-attention: each of fairseq's decoder-side arguments is refused by itself."""
    _, module = attention_pair("GLFB")
    x, _ = padded_input(left_pad=True)
    with pytest.raises(ValueError, match="is an encoder self-attention"):
        module(x, x, x, **unsupported)


def test_printed_module_names_its_heads_and_window():
    assert "head_types=G,L,F,B, window=2" in repr(MixedMultiheadAttention(D, HEADS, "GLFB", 2))


@NORMS
def test_all_global_model_equals_fairseq_transformer_with_its_weights(norm):
    dictionary = toy_dictionary()
    reference = build_model("transformer", *norm, dictionary=dictionary).eval()
    model = build_model("slot_transformer", *mixed("G", "G"), *norm, dictionary=dictionary).eval()
    assert isinstance(model.encoder.layers[0].self_attn, MixedMultiheadAttention)
    model.load_state_dict(reference.state_dict(), strict=True)
    src, lengths, prev = random_batch(dictionary)
    with torch.no_grad():
        torch.testing.assert_close(model(src, lengths, prev)[0], reference(src, lengths, prev)[0],
                                   atol=1e-5, rtol=1e-5)


def test_a_window_covering_the_sentence_equals_global():
    length = 7
    _, global_heads = attention_pair("GGGG")
    for window in (length - 1, 100):
        local = MixedMultiheadAttention(D, HEADS, "LLLL", window).eval()
        local.load_state_dict(global_heads.state_dict())
        x, pad = padded_input(left_pad=True, length=length)
        torch.testing.assert_close(local(x, x, x, key_padding_mask=pad)[0],
                                   global_heads(x, x, x, key_padding_mask=pad)[0])
    narrow = MixedMultiheadAttention(D, HEADS, "LLLL", length - 2).eval()
    narrow.load_state_dict(global_heads.state_dict())
    assert not torch.allclose(narrow(x, x, x)[0], global_heads(x, x, x)[0])


def test_forward_heads_on_reversed_input_equal_reversed_backward_heads():
    """F(flip(x)) = flip(B(x))."""
    _, forward = attention_pair("FFFF")
    backward = MixedMultiheadAttention(D, HEADS, "BBBB", 1).eval()
    backward.load_state_dict(forward.state_dict())
    x, _ = padded_input(left_pad=True)
    torch.testing.assert_close(forward(x.flip(0), x.flip(0), x.flip(0))[0], backward(x, x, x)[0].flip(0))


def test_mixed_heads_equal_fairseq_energies_plus_the_masks():
    """Eq. 7 with fairseq's own energies (``before_softmax``, B*H x T x S, flattened b*H + h)
    and the masks expanded as the paper's head order means: head h is channel slice h."""
    reference, module = attention_pair("GLFB")
    reference.skip_embed_dim_check = True  # fairseq's explicit path, which has before_softmax
    x, _ = padded_input(left_pad=True)
    length, batch_size, _ = x.shape
    energies, v = reference(x, x, x, before_softmax=True)
    masks = head_masks(tuple("GLFB"), 1, length, CPU).repeat(batch_size, 1, 1)
    context = torch.bmm(energies.masked_fill(~masks, float("-inf")).softmax(-1), v)
    expected = reference.out_proj(context.transpose(0, 1).reshape(length, batch_size, D))
    torch.testing.assert_close(module(x, x, x)[0], expected, atol=1e-6, rtol=1e-5)


def test_head_weights_follow_the_masks():
    _, module = attention_pair("GLFB")
    x, pad = padded_input(left_pad=True)
    out, weights = module(x, x, x, key_padding_mask=pad, need_head_weights=True)
    assert weights.shape == (HEADS, x.size(1), x.size(0), x.size(0))  # H x B x T x S
    allowed = allowed_keys(head_masks(tuple("GLFB"), 1, x.size(0), CPU), pad).transpose(0, 1)
    assert (weights[~allowed] == 0).all()
    torch.testing.assert_close(weights.sum(-1), torch.ones_like(weights.sum(-1)))
    torch.testing.assert_close(out, module(x, x, x, key_padding_mask=pad, need_weights=False)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("left_pad", [True, False], ids=["left-pad", "right-pad"])
def test_no_nan_in_outputs_or_gradients_with_padding(left_pad, dtype):
    """Pad query rows of B/L heads (left padding) and F/L heads (right padding) see only pad
    keys; two stacked layers carry a NaN at pads into real tokens."""
    torch.manual_seed(0)
    layers = [MixedMultiheadAttention(D, HEADS, "GLFB", 1, dropout=0.1).to(dtype) for _ in range(2)]
    x, pad = padded_input(left_pad, dtype=dtype)
    structural = head_masks(tuple("GLFB"), 1, x.size(0), CPU)
    assert not (structural[None] & ~pad[:, None, None, :]).any(-1).all(), "no fully masked row"
    for need_weights in (False, True):
        h = x.clone().requires_grad_()
        out = h
        for layer in layers:
            out = layer(out, out, out, key_padding_mask=pad, need_weights=need_weights)[0]
        out.float().pow(2).sum().backward()
        assert torch.isfinite(out).all()
        assert torch.isfinite(h.grad).all()
        assert all(torch.isfinite(p.grad).all() for layer in layers for p in layer.parameters())
        for layer in layers:
            layer.zero_grad()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("left_pad", [True, False], ids=["left-pad", "right-pad"])
def test_model_training_step_is_finite_with_padding(left_pad, dtype):
    dictionary = toy_dictionary()
    model = build_model("slot_transformer", *mixed("F", "B"), "--attention-dropout", "0.1",
                        dictionary=dictionary).to(dtype).train()
    src, lengths, prev = random_batch(dictionary, left_pad=left_pad)
    logits = model(src, lengths, prev)[0]
    logits.float().logsumexp(-1).sum().backward()
    assert torch.isfinite(logits).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def encoder_output(model, src):
    return model.encoder(src, src_lengths=torch.full((src.size(0),), src.size(1)))["encoder_out"][0]


@pytest.mark.parametrize("heads, equivariant", [(("G", "G"), True), (("F", "B"), False), (("G", "L"), False)])
def test_without_positions_only_global_heads_are_permutation_equivariant(heads, equivariant):
    """Table 3's reason (Cui et al. 2019, §5.1): without positional embeddings, permuting the source
    permutes a global-only encoder's output; the directional and local masks break that."""
    dictionary = toy_dictionary()
    model = build_model("slot_transformer", *mixed(*heads), "--encoder-no-token-positional-embeddings",
                        dictionary=dictionary).eval()
    assert model.encoder.embed_positions is None and model.decoder.embed_positions is not None
    src, _, _ = random_batch(dictionary, batch_size=2, left_pad=True)
    src = src[:, -5:]  # no padding
    permutation = torch.tensor([3, 0, 4, 1, 2])
    with torch.no_grad():
        permuted_output = encoder_output(model, src[:, permutation])
        output_permuted = encoder_output(model, src)[permutation]
    assert torch.allclose(permuted_output, output_permuted, atol=1e-5) == equivariant


def test_positions_are_dropped_from_the_encoder_only():
    dictionary = toy_dictionary()
    reference = build_model("slot_transformer", "--encoder-no-token-positional-embeddings",
                            "--encoder-learned-pos", "--decoder-learned-pos", dictionary=dictionary)
    assert reference.encoder.embed_positions is None and reference.decoder.embed_positions is not None
    both = build_model("slot_transformer", "--encoder-learned-pos", "--decoder-learned-pos", dictionary=dictionary)
    assert num_params(both) - num_params(reference) == both.encoder.embed_positions.weight.numel()


def test_parameter_count_equals_the_baseline():
    assert num_params(build_model("slot_transformer", *mixed("G", "L"))) == num_params(build_model("transformer"))


def test_iwslt_preset_has_the_papers_sizes_and_parameter_count():
    dictionary = toy_dictionary([f"w{i}" for i in range(1000)])
    model = build_model("mma_transformer_iwslt_de_en", "--encoder-attention-heads", "4",
                        "--encoder-layers", "6", "--encoder-embed-dim", "512", "--encoder-ffn-embed-dim",
                        "1024", dictionary=dictionary)
    baseline = build_model("transformer_iwslt_de_en", "--encoder-attention-heads", "4",
                           "--encoder-layers", "6", "--encoder-embed-dim", "512", "--encoder-ffn-embed-dim",
                           "1024", dictionary=dictionary)
    attention = [layer.self_attn for layer in model.encoder.layers]
    assert all(a.head_types == ("G", "L", "F", "B") and a.window == 1 for a in attention)
    assert model.encoder.layers[0].dropout_module.p == 0.3
    assert num_params(model) == num_params(baseline)


def test_iwslt_preset_with_standard_attention_is_fairseqs_baseline():
    """Table 3's and Table 4's baseline is the preset with --encoder-self-attention standard."""
    dictionary = toy_dictionary()
    reference = build_model("transformer_iwslt_de_en", "--dropout", "0.3", dictionary=dictionary).eval()
    model = build_model("mma_transformer_iwslt_de_en", "--encoder-self-attention", "standard",
                        dictionary=dictionary).eval()
    assert model.encoder.layers[0].dropout_module.p == 0.3
    model.load_state_dict(reference.state_dict(), strict=True)
    src, lengths, prev = random_batch(dictionary)
    with torch.no_grad():
        torch.testing.assert_close(model(src, lengths, prev)[0], reference(src, lengths, prev)[0])


def test_wat_preset_has_two_heads_of_each_type():
    model = build_model("mma_transformer_wat", "--encoder-attention-heads", "8")
    assert model.encoder.layers[-1].self_attn.head_types == tuple("GGLLFFBB")
    assert model.encoder.layers[0].dropout_module.p == 0.1


@pytest.mark.parametrize("num_heads, expected", [(4, "GLFB"), (8, "GGLLFFBB"), (2, "GF"), (6, "GGLFFB")])
def test_default_heads_are_blocks_in_the_order_g_l_f_b(num_heads, expected):
    assert default_head_types(num_heads) == tuple(expected)


def test_mma_layers_keep_fairseq_attention_elsewhere():
    model = build_model("slot_transformer", *mixed("F", "B"), "--mma-layers", "1,3")
    kinds = [type(layer.self_attn) for layer in model.encoder.layers]
    assert kinds == [MixedMultiheadAttention, MultiheadAttention, MixedMultiheadAttention]
    assert all(type(layer.self_attn) is MultiheadAttention for layer in model.decoder.layers)


@pytest.mark.parametrize(
    "options, message",
    [
        (mixed("G", "X"), r"--mma-heads 'G,X': unknown head type\(s\) \['X'\]"),
        (mixed("G", "L", "F"), "lists 3 head type"),
        (mixed("G", "L", window=-1), "--mma-local-window -1"),
        (mixed("G", "L") + ["--mma-layers", "0"], "--mma-layers '0': 0 is not a range of encoder layers within 1..3"),
        (mixed("G", "L") + ["--mma-layers", "2-4"], "not a range of encoder layers within 1..3"),
        (mixed("G", "L") + ["--mma-layers", "3-1"], "not a range of encoder layers"),
        (mixed("G", "L") + ["--mma-layers", "first"], "--mma-layers 'first': expected none, all, or 1-based layers"),
    ],
)
def test_bad_configurations_are_refused_with_a_clear_message(options, message):
    with pytest.raises(ValueError, match=message):
        build_model("slot_transformer", *options)


def test_train_generate_round_trip_and_attention_dump(data_bin, tmp_path):
    from mlmha_fairseq.cli import dump_attention

    assert_round_trip(data_bin, tmp_path, "slot_transformer", *mixed("F", "B"), "--mma-layers", "2-3",
                      "--encoder-no-token-positional-embeddings")
    source = tmp_path / "src.txt"
    source.write_text("w1 w2 w3\nw4 w5 w6 w7 w8\n", encoding="utf-8")
    out = tmp_path / "dump"
    dump_attention.main([str(tmp_path / "checkpoint_last.pt"), "--data-bin", str(data_bin),
                         "--input", str(source), "--lines", "2", "1", "--output-dir", str(out)])
    index = json.loads((out / "attention.json").read_text())
    assert index["head_types"] == [["G", "G"], ["F", "B"], ["F", "B"]]
    assert [s["line"] for s in index["sentences"]] == [2, 1]
    assert index["sentences"][1]["tokens"] == ["w1", "w2", "w3", "</s>"]
    data = np.load(out / "line2.npz")
    weights = data["weights"]
    assert weights.shape == (3, 2, 6, 6) and list(data["tokens"]) == index["sentences"][0]["tokens"]
    np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-5)
    assert (np.tril(weights[1, 0], -1) == 0).all() and (np.triu(weights[1, 1], 1) == 0).all()
    assert (out / "line1.png").stat().st_size > 0 and (out / "line2.png").exists()


def test_head_types_are_named_by_letter_or_by_name_in_any_case():
    """``--mma-heads`` takes the paper's letters or the full names, case-insensitively."""
    expected = ("G", "L", "F", "B")
    assert parse_head_types("global,Local,FORWARD,backward", 4) == expected
    assert parse_head_types("g, l,F,B", 4) == expected
