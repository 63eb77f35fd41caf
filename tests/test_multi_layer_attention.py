"""Module-level tests of MLMHA (Eqs. 7-12) and the Source Feature Collector."""

import pytest
import torch
from fairseq.modules import MultiheadAttention

from mlmha_fairseq.modules.multi_layer_attention import (
    MultiLayerMultiheadAttention,
    _attention_masks,
    parse_variant,
)
from mlmha_fairseq.modules.source_feature_collector import SourceFeatureCollector

DIM, HEADS, TAPS = 16, 4, 3
SRC_LEN, TGT_LEN, BSZ = 6, 4, 3
VARIANTS = ["M-00", "M-01", "M-10", "M-11"]
ATOL = 1e-5


def build(variant, num_taps=TAPS, bias=False, seed=0):
    torch.manual_seed(seed)
    joint, concat = parse_variant(variant)
    module = MultiLayerMultiheadAttention(DIM, HEADS, num_taps, joint, concat, bias=bias)
    return module.eval()


def make_inputs(num_taps=TAPS, bsz=BSZ, seed=1):
    """Random query, taps and a right-padded mask (row b has b pads)."""
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(TGT_LEN, bsz, DIM, generator=generator)
    taps = torch.randn(num_taps, SRC_LEN, bsz, DIM, generator=generator)
    lengths = torch.tensor([SRC_LEN - b % SRC_LEN for b in range(bsz)])
    mask = torch.arange(SRC_LEN)[None, :] >= lengths[:, None]
    return query, taps, mask


def run(module, query, taps, mask, **kwargs):
    return module(query, taps, taps, key_padding_mask=mask, static_kv=True, **kwargs)


def tap_projection(weight, bias, tap, inputs):
    """``inputs W_tap^T + b_tap`` split into heads: T x B x H x d_k."""
    projected = inputs @ weight[tap].T
    if bias is not None:
        projected = projected + bias[tap]
    return projected.view(*inputs.shape[:2], HEADS, DIM // HEADS)


def tap_scores(module, query, taps, tap):
    """Eq. 7, ``alpha^i``: B x H x Tt x Ts."""
    q = tap_projection(module.q_proj_weight, module.q_proj_bias, tap, query)
    k = tap_projection(module.k_proj_weight, module.k_proj_bias, tap, taps[tap])
    return torch.einsum("tbhd,sbhd->bhts", q, k) / (DIM // HEADS) ** 0.5


def masked_softmax(scores, mask):
    return scores.masked_fill(mask[:, None, None, :], float("-inf")).softmax(-1)


def per_tap_probs(module, query, taps, mask):
    """Eq. 8 distributions, one per tap: n x B x H x Tt x Ts."""
    scores = [tap_scores(module, query, taps, tap) for tap in range(taps.size(0))]
    return torch.stack([masked_softmax(score, mask) for score in scores])


def copy_from_fairseq(module, reference):
    """Load a fairseq MultiheadAttention's weights into a one-tap MLMHA."""
    with torch.no_grad():
        for name in ("q", "k", "v"):
            linear = getattr(reference, f"{name}_proj")
            getattr(module, f"{name}_proj_weight")[0].copy_(linear.weight)
            if linear.bias is not None:
                getattr(module, f"{name}_proj_bias")[0].copy_(linear.bias)
        module.out_proj.load_state_dict(reference.out_proj.state_dict())


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("bias", [True, False])
def test_single_tap_equals_fairseq_encoder_attention(variant, bias):
    module = build(variant, num_taps=1, bias=bias)
    reference = MultiheadAttention(DIM, HEADS, encoder_decoder_attention=True, bias=bias)
    reference.eval()
    copy_from_fairseq(module, reference)
    query, taps, mask = make_inputs(num_taps=1)
    expected, expected_weights = run(reference, query, taps[0], mask, need_weights=True)
    _, expected_head_weights = run(reference, query, taps[0], mask, need_head_weights=True)
    out, weights = run(module, query, taps, mask, need_weights=True)
    fused, no_weights = run(module, query, taps, mask)
    _, head_weights = run(module, query, taps, mask, need_head_weights=True)
    assert no_weights is None
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(fused, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(weights, expected_weights, atol=ATOL, rtol=0)
    torch.testing.assert_close(head_weights, expected_head_weights, atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", ["M-00", "M-01"])
def test_joint_weights_are_softmax_of_summed_scores(variant):
    module = build(variant, bias=True)
    query, taps, mask = make_inputs()
    _, weights = run(module, query, taps, mask, need_head_weights=True)  # H x B x Tt x Ts
    summed = sum(tap_scores(module, query, taps, tap) for tap in range(TAPS))
    expected = masked_softmax(summed, mask).transpose(0, 1)
    torch.testing.assert_close(weights, expected, atol=ATOL, rtol=0)
    # Not the mean of per-tap distributions (which is what layer-specific reports).
    per_tap = per_tap_probs(module, query, taps, mask)
    assert not torch.allclose(weights, per_tap.mean(0).transpose(0, 1), atol=1e-3)


@pytest.mark.parametrize("variant", ["M-10", "M-11"])
def test_layer_specific_weights_are_one_softmax_per_tap(variant):
    module = build(variant, bias=True)
    query, taps, mask = make_inputs()
    _, weights = run(module, query, taps, mask, need_head_weights=True)
    per_tap = per_tap_probs(module, query, taps, mask).mean(0).transpose(0, 1)
    torch.testing.assert_close(weights, per_tap, atol=ATOL, rtol=0)
    _, averaged = run(module, query, taps, mask, need_weights=True)
    torch.testing.assert_close(averaged, weights.mean(0), atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_outputs_match_hand_computation(variant):
    """Eqs. 8-12 written per tap and per head, against the fused module."""
    module = build(variant, bias=True)
    joint, concat = parse_variant(variant)
    query, taps, mask = make_inputs()
    summed_scores = sum(tap_scores(module, query, taps, tap) for tap in range(TAPS))
    joint_probs = masked_softmax(summed_scores, mask)
    layer_probs = per_tap_probs(module, query, taps, mask)
    contexts = []
    for tap in range(TAPS):
        probs = joint_probs if joint else layer_probs[tap]
        value = tap_projection(module.v_proj_weight, module.v_proj_bias, tap, taps[tap])
        context = torch.einsum("bhts,sbhd->tbhd", probs, value)
        contexts.append(context.reshape(TGT_LEN, BSZ, DIM))
    combined = torch.cat(contexts, -1) if concat else sum(contexts)
    out, _ = run(module, query, taps, mask)
    torch.testing.assert_close(out, module.out_proj(combined), atol=ATOL, rtol=0)


def test_m01_uses_joint_weights_on_summed_values():
    """M-01: ``O = W_o(alpha_hat * sum_i V_i)`` per head."""
    module = build("M-01")
    query, taps, mask = make_inputs()
    _, weights = run(module, query, taps, mask, need_head_weights=True)  # H x B x Tt x Ts
    value_sum = sum(
        tap_projection(module.v_proj_weight, None, tap, taps[tap]) for tap in range(TAPS)
    )
    context = torch.einsum("hbts,sbhd->tbhd", weights, value_sum)
    out, _ = run(module, query, taps, mask)
    expected = module.out_proj(context.reshape(TGT_LEN, BSZ, DIM))
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_weights_are_distributions_with_zero_weight_on_pads(variant):
    module = build(variant)
    query, taps, mask = make_inputs()
    _, weights = run(module, query, taps, mask, need_head_weights=True)
    assert mask.any()
    assert torch.all(weights.masked_select(mask[None, :, None, :]) == 0)
    torch.testing.assert_close(weights.sum(-1), torch.ones(HEADS, BSZ, TGT_LEN))


@pytest.mark.parametrize("variant", VARIANTS)
def test_left_and_right_padding_agree(variant):
    module = build(variant, bias=True)
    query, taps, _ = make_inputs(bsz=1)
    length = SRC_LEN - 2
    garbage = torch.randn(TAPS, 2, 1, DIM)
    right = torch.cat([taps[:, :length], garbage], 1)
    left = torch.cat([garbage, taps[:, :length]], 1)
    right_mask = torch.arange(SRC_LEN)[None, :] >= length
    left_mask = right_mask.flip(-1)
    out_right, w_right = run(module, query, right, right_mask, need_weights=True)
    out_left, w_left = run(module, query, left, left_mask, need_weights=True)
    fused_left, _ = run(module, query, left, left_mask)
    torch.testing.assert_close(out_left, out_right, atol=ATOL, rtol=0)
    torch.testing.assert_close(fused_left, out_right, atol=ATOL, rtol=0)
    torch.testing.assert_close(w_left[..., 2:], w_right[..., :length], atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_fully_padded_row_gives_no_nan(variant):
    module = build(variant, bias=True).train()
    query, taps, mask = make_inputs()
    mask[0] = True
    query.requires_grad_(True)
    for kwargs in ({}, {"need_weights": True}):  # the fused path, then explicit weights
        out, weights = run(module, query, taps, mask, **kwargs)
        out.sum().backward()
        assert torch.isfinite(out).all() and torch.isfinite(query.grad).all()
        # Its context is zero in both paths: only the output bias remains.
        torch.testing.assert_close(out[:, 0], module.out_proj.bias.expand(TGT_LEN, DIM))
        # The other rows keep the attention over their keys (not zeroed).
        assert not torch.allclose(out[:, 1:], module.out_proj.bias.expand(TGT_LEN, BSZ - 1, DIM))
    assert torch.all(weights[0] == 0)


def test_fully_padded_row_attends_somewhere_before_zeroing():
    """No row of the attention mask is empty, whatever the kernel does with one."""
    mask = torch.tensor([[True, True, True], [False, False, True]])
    attend, empty = _attention_masks(mask)
    assert attend.shape == (2, 1, 1, 3) and empty.shape == (2, 1, 1, 1)
    assert attend.any(-1).all()
    assert empty.flatten().tolist() == [True, False]
    assert attend[1].flatten().tolist() == [True, True, False]


def step_by_step(module, query, taps, mask, state, start=0, keys_after_first=None):
    outputs = []
    for t in range(start, query.size(0)):
        key = taps if t == start else keys_after_first
        out, _ = run(module, query[t : t + 1], key, mask, incremental_state=state)
        outputs.append(out)
    return torch.cat(outputs, 0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_incremental_equals_full_and_projects_taps_once(variant, monkeypatch):
    module = build(variant, bias=True)
    query, taps, mask = make_inputs()
    expected, _ = run(module, query, taps, mask)
    calls = []
    project = module._project_taps
    monkeypatch.setattr(module, "_project_taps", lambda t: calls.append(1) or project(t))
    for keys_after_first in (None, taps):
        calls.clear()
        state = {}
        out = step_by_step(module, query, taps, mask, state, keys_after_first=keys_after_first)
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
        assert len(calls) == 1


def reorder_then_decode(module, query, taps, mask, new_order):
    """First step on the batch, reorder the cache by ``new_order``, then the other
    steps on the reordered batch; returns those steps and the cache before and after."""
    state = {}
    module(query[:1], taps, taps, key_padding_mask=mask, incremental_state=state)
    before = dict(module._get_input_buffer(state))
    returned = module.reorder_incremental_state(state, new_order)
    assert returned is state
    after = dict(module._get_input_buffer(state))
    out = step_by_step(module, query.index_select(1, new_order), None, mask, state, start=1)
    return out, before, after


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("new_order", [[2, 0, 3, 3, 1, 4], [4, 1], [0, 0, 0]])
def test_reorder_incremental_state_selects_rows_when_the_batch_changes(variant, new_order):
    """The first expansion to the beams and finished sentences leaving the batch."""
    module = build(variant, bias=True)
    query, taps, mask = make_inputs(bsz=5)
    new_order = torch.tensor(new_order)
    out, _, _ = reorder_then_decode(module, query, taps, mask, new_order)
    expected, _ = run(
        module,
        query.index_select(1, new_order),
        taps.index_select(2, new_order),
        mask.index_select(0, new_order),
    )
    torch.testing.assert_close(out, expected[1:], atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_reorder_within_the_beams_of_a_sentence_keeps_the_cache(variant):
    """Beam search at an unchanged batch size: 3 sentences x beam 2, hypotheses move
    between the two beams of their sentence (which share its encoder taps and mask).
    The cached projections are not copied, and decoding equals the full forward."""
    module = build(variant, bias=True)
    query, taps, mask = make_inputs(bsz=6)
    sentence_rows = torch.tensor([0, 0, 2, 2, 4, 4])  # each sentence's taps twice
    taps, mask = taps.index_select(2, sentence_rows), mask.index_select(0, sentence_rows)
    new_order = torch.tensor([1, 1, 3, 2, 4, 5])
    out, before, after = reorder_then_decode(module, query, taps, mask, new_order)
    assert all(after[name] is cached for name, cached in before.items())
    expected, _ = run(module, query.index_select(1, new_order), taps, mask)
    torch.testing.assert_close(out, expected[1:], atol=ATOL, rtol=0)


def test_incremental_state_is_per_module():
    first, second = build("M-00", seed=0), build("M-00", seed=1)
    query, taps, mask = make_inputs()
    state = {}
    for module in (first, second):
        out = step_by_step(module, query, taps, mask, state)
        torch.testing.assert_close(out, run(module, query, taps, mask)[0], atol=ATOL, rtol=0)
    assert len(state) == 2


def closed_form_params(num_taps, dim, concat, bias):
    """Ampomah et al. 2020, §4.1 (Eqs. 7-12): 3n d^2 + d_c d (+ 3n d + d with biases)."""
    context_dim = num_taps * dim if concat else dim
    count = 3 * num_taps * dim * dim + context_dim * dim
    return count + (3 * num_taps * dim + dim if bias else 0)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("num_taps", [1, 2, 4])
def test_parameter_count_closed_form(variant, bias, num_taps):
    module = build(variant, num_taps=num_taps, bias=bias)
    concat = parse_variant(variant)[1]
    assert sum(p.numel() for p in module.parameters()) == closed_form_params(
        num_taps, DIM, concat, bias
    )
    assert module.out_proj.in_features == (num_taps * DIM if concat else DIM)


def extras_over_baseline(num_layers, dim, heads, num_taps, concat, bias):
    """Parameters MLMHA adds over fairseq's enc-dec attention, for ``num_layers`` layers."""
    with torch.device("meta"):
        module = MultiLayerMultiheadAttention(dim, heads, num_taps, True, concat, bias=bias)
        baseline = MultiheadAttention(dim, heads, encoder_decoder_attention=True, bias=bias)
    extra = sum(p.numel() for p in module.parameters())
    return num_layers * (extra - sum(p.numel() for p in baseline.parameters()))


def test_parameter_count_wmt_en_de_example():
    """Thesis §3.5.2 (Ampomah et al. 2020, §7.2): with n = 6 MLMHA adds "about 23.7M" and
    contexts-concatenation "a further 7.8M"; n = 6, d = 512, 8 heads, 6 decoder layers."""
    summed = extras_over_baseline(6, 512, 8, 6, concat=False, bias=False)
    concatenated = extras_over_baseline(6, 512, 8, 6, concat=True, bias=False)
    assert summed == 23_592_960
    assert concatenated - summed == 7_864_320
    assert concatenated == 31_457_280
    assert round(extras_over_baseline(6, 512, 8, 6, concat=False, bias=True) / 1e6, 2) == 23.64


def test_parameter_names():
    module = build("M-10", bias=True)
    assert set(module.state_dict()) == {
        "q_proj_weight", "k_proj_weight", "v_proj_weight",
        "q_proj_bias", "k_proj_bias", "v_proj_bias",
        "out_proj.weight", "out_proj.bias",
    }
    assert module.q_proj_weight.shape == (TAPS, DIM, DIM)


def test_init_matches_fairseq_scale():
    """Xavier-uniform bounds: q/k/v gain 1/sqrt(2) per tap, out_proj gain 1, zero out bias."""
    module = build("M-00", bias=True)
    qkv_bound = (6 / (2 * DIM)) ** 0.5 / 2**0.5
    out_bound = (6 / (TAPS * DIM + DIM)) ** 0.5
    for weight in (module.q_proj_weight, module.k_proj_weight, module.v_proj_weight):
        assert weight.abs().max() <= qkv_bound and weight.abs().max() > 0.8 * qkv_bound
    assert module.out_proj.weight.abs().max() <= out_bound
    assert torch.all(module.out_proj.bias == 0)
    # q/k/v biases keep nn.Linear's default U(-1/sqrt(d), 1/sqrt(d)), as in fairseq: within
    # the bound and spread over both halves of the interval.
    bias_bound = DIM**-0.5
    for bias in (module.q_proj_bias, module.k_proj_bias, module.v_proj_bias):
        assert bias.abs().max() <= bias_bound
        assert bias.min() < -bias_bound / 2 and bias.max() > bias_bound / 2


def test_parse_variant():
    assert parse_variant("M-00") == (True, True)
    assert parse_variant("M-01") == (True, False)
    assert parse_variant("M-10") == (False, True)
    assert parse_variant("M-11") == (False, False)
    with pytest.raises(ValueError, match="M-00"):
        parse_variant("M-2")


def test_dropout_applies_only_in_training():
    torch.manual_seed(0)
    module = MultiLayerMultiheadAttention(DIM, HEADS, TAPS, True, True, dropout=0.5)
    query, taps, mask = make_inputs()
    module.eval()
    first, second = run(module, query, taps, mask)[0], run(module, query, taps, mask)[0]
    assert torch.equal(first, second)
    module.train()
    first, second = run(module, query, taps, mask)[0], run(module, query, taps, mask)[0]
    assert not torch.allclose(first, second)
    # Like fairseq, the reported weights are the probabilities before dropout.
    _, weights = run(module, query, taps, mask, need_head_weights=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(HEADS, BSZ, TGT_LEN))


def encoder_states(num_layers, seed=2):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(SRC_LEN, BSZ, DIM, generator=generator) for _ in range(num_layers + 1)]


def test_collector_post_norm_takes_top_layers_bottom_to_top():
    states = encoder_states(4)
    taps = SourceFeatureCollector(3, DIM, normalize_before=False)(states, states[-1])
    assert taps.shape == (3, SRC_LEN, BSZ, DIM)
    assert torch.equal(taps, torch.stack(states[2:]))
    assert sum(p.numel() for p in SourceFeatureCollector(3, DIM, False).parameters()) == 0


def test_collector_pre_norm_normalises_lower_taps_and_keeps_encoder_out():
    states = encoder_states(4)
    encoder_out = torch.randn(SRC_LEN, BSZ, DIM)
    collector = SourceFeatureCollector(3, DIM, normalize_before=True)
    with torch.no_grad():
        for norm in collector.layer_norms:
            norm.weight.uniform_()
    taps = collector(states, encoder_out)
    assert sum(p.numel() for p in collector.parameters()) == 2 * 2 * DIM
    for tap, (norm, state) in enumerate(zip(collector.layer_norms, states[2:4])):
        torch.testing.assert_close(taps[tap], norm(state))
    assert torch.equal(taps[-1], encoder_out)
    single = SourceFeatureCollector(1, DIM, normalize_before=True)(states, encoder_out)
    assert torch.equal(single, encoder_out[None])


def test_collector_validates_n_and_zeroed_layer():
    states = encoder_states(2)
    with pytest.raises(ValueError, match="1 <= n <= L"):
        SourceFeatureCollector(3, DIM, False)(states, states[-1])
    with pytest.raises(ValueError):
        SourceFeatureCollector(0, DIM, False)
    collector = SourceFeatureCollector(1, DIM, False)
    collector.zeroed_layer = 1
    with pytest.raises(ValueError, match="layers 2..2"):
        collector(states, states[-1])


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("layer", [2, 3, 4])
def test_zeroing_a_layer_equals_dropping_its_tap(variant, layer):
    """The encoder-layer masking ablation (thesis §3.5.4, Table 3.5; Ampomah et al. 2020, §7.4,
    Table 7) with bias-free projections."""
    num_layers = 4
    states = encoder_states(num_layers)
    collector = SourceFeatureCollector(TAPS, DIM, normalize_before=True)
    module = build(variant)
    query, _, mask = make_inputs()
    tap = layer - (num_layers - TAPS) - 1
    collector.zeroed_layer = layer
    zeroed = collector(states, states[-1])
    assert torch.all(zeroed[tap] == 0) and zeroed.abs().sum() > 0
    expected, expected_weights = run(module, query, zeroed, mask, need_weights=True)
    collector.zeroed_layer = None
    full = collector(states, states[-1])
    intact, _ = run(module, query, full, mask)
    module.dropped_layer_index = tap
    out, weights = run(module, query, full, mask, need_weights=True)
    fused, _ = run(module, query, full, mask)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(fused, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(weights, expected_weights, atol=ATOL, rtol=0)
    assert not torch.allclose(out, intact, atol=1e-3)


def test_dropped_layer_index_is_validated():
    module = build("M-00")
    with pytest.raises(ValueError, match="dropped_layer_index"):
        module.dropped_layer_index = TAPS


# ----------------------------------------------------------------------------- optional sharing

SHARINGS = [(True, False), (False, True), (True, True)]
SHARING_IDS = ["share-query", "share-kv", "share-both"]


def build_shared(variant, share_query, share_kv, bias=True, seed=0):
    torch.manual_seed(seed)
    joint, concat = parse_variant(variant)
    return MultiLayerMultiheadAttention(DIM, HEADS, TAPS, joint, concat, bias=bias,
                                        share_query=share_query, share_kv=share_kv).eval()


def untied_copy(shared):
    """The unshared module with every tap's projection a copy of the shared one."""
    joint, concat = shared.joint_weights, shared.concat_contexts
    untied = MultiLayerMultiheadAttention(DIM, HEADS, TAPS, joint, concat, bias=True).eval()
    with torch.no_grad():
        for name, parameter in shared.named_parameters():
            untied.get_parameter(name).copy_(parameter.expand_as(untied.get_parameter(name)))
    return untied


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("share_query, share_kv", SHARINGS, ids=SHARING_IDS)
def test_sharing_is_the_per_tap_module_with_tied_projections(variant, share_query, share_kv):
    """One projection applied to every tap: the same outputs and weights as per-tap
    projections that are copies of it, and its gradient is the sum of theirs."""
    shared = build_shared(variant, share_query, share_kv)
    assert shared.q_proj_weight.shape[0] == (1 if share_query else TAPS)
    assert shared.k_proj_weight.shape[0] == shared.v_proj_bias.shape[0] == (1 if share_kv else TAPS)
    untied = untied_copy(shared)
    query, taps, mask = make_inputs()
    out, weights = run(shared, query, taps, mask, need_head_weights=True)
    expected, expected_weights = run(untied, query, taps, mask, need_head_weights=True)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(weights, expected_weights, atol=ATOL, rtol=0)
    torch.testing.assert_close(run(shared, query, taps, mask)[0], expected, atol=ATOL, rtol=0)
    out.pow(2).sum().backward()
    expected.pow(2).sum().backward()
    for name, parameter in shared.named_parameters():
        untied_grad = untied.get_parameter(name).grad
        if parameter.size(0) == 1 and untied_grad.size(0) == TAPS:
            untied_grad = untied_grad.sum(0, keepdim=True)
        torch.testing.assert_close(parameter.grad, untied_grad, atol=1e-4, rtol=1e-4)


def test_shared_projections_differ_from_independent_ones():
    """Sharing changes the function (a shared module is not the default one re-labelled)."""
    query, taps, mask = make_inputs()
    shared = build_shared("M-00", True, True)
    independent = build_shared("M-00", False, False)
    with torch.no_grad():
        independent.q_proj_weight[0].copy_(shared.q_proj_weight[0])
        independent.k_proj_weight[0].copy_(shared.k_proj_weight[0])
        independent.v_proj_weight[0].copy_(shared.v_proj_weight[0])
    assert not torch.allclose(run(shared, query, taps, mask)[0], run(independent, query, taps, mask)[0])


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("share_query, share_kv", SHARINGS, ids=SHARING_IDS)
def test_sharing_incremental_equals_full(variant, share_query, share_kv):
    module = build_shared(variant, share_query, share_kv)
    query, taps, mask = make_inputs()
    expected, _ = run(module, query, taps, mask)
    out = step_by_step(module, query, taps, mask, {})
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("share_query, share_kv", SHARINGS, ids=SHARING_IDS)
@pytest.mark.parametrize("num_taps", [1, 4])
def test_sharing_parameter_count_closed_form(variant, bias, share_query, share_kv, num_taps):
    """(n_q + 2 n_kv) d^2 + d_c d (+ (n_q + 2 n_kv) d + d with biases), n_q = 1 with
    share_query, n_kv = 1 with share_kv (else n)."""
    torch.manual_seed(0)
    joint, concat = parse_variant(variant)
    module = MultiLayerMultiheadAttention(DIM, HEADS, num_taps, joint, concat, bias=bias,
                                          share_query=share_query, share_kv=share_kv)
    projections = (1 if share_query else num_taps) + 2 * (1 if share_kv else num_taps)
    context_dim = num_taps * DIM if concat else DIM
    expected = projections * DIM * DIM + context_dim * DIM + ((projections + 1) * DIM if bias else 0)
    assert sum(p.numel() for p in module.parameters()) == expected


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_tensor_follows_the_device_of_the_taps(variant):
    """The attention masks and the index of the dropped tap (``dropped_layer_index``, the
    drop mode of the encoder-layer masking ablation, thesis §3.5.4) are made on the taps' device
    (checked on PyTorch's meta device, which refuses to mix with CPU tensors, so no GPU is
    needed)."""
    joint, concat = parse_variant(variant)
    with torch.device("meta"):
        module = MultiLayerMultiheadAttention(DIM, HEADS, TAPS, joint, concat, bias=True,
                                              dropped_layer_index=1).eval()
    query = torch.empty(TGT_LEN, BSZ, DIM, device="meta")
    taps = torch.empty(TAPS, SRC_LEN, BSZ, DIM, device="meta")
    mask = torch.zeros(BSZ, SRC_LEN, dtype=torch.bool, device="meta")
    for need_weights in (False, True):
        out, weights = run(module, query, taps, mask, need_weights=need_weights)
        assert out.is_meta and out.shape == (TGT_LEN, BSZ, DIM)
        assert weights is None or (weights.is_meta and weights.shape == (BSZ, TGT_LEN, SRC_LEN))
