"""Multi-source Transformer: serial, parallel, flat and hierarchical input combination
(Libovický et al. 2018)."""
import argparse
import json
import re
import shutil

import numpy as np
import pytest
import torch
from fairseq import options
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.models import ARCH_CONFIG_REGISTRY

from fairseq_helpers import (
    N_WAY_SPLITS,
    NORMS,
    TINY_MODEL_ARGS,
    USER_DIR,
    VOCAB,
    binarize_n_way,
    build_model,
    generate,
    hypotheses_and_references,
    random_batch,
    run_fairseq,
    toy_dictionary,
    train_args,
    write_n_way_text,
)
from fixtures.tiny_fairseq import save_checkpoint
from mlmha_fairseq.cli import multi_source_attention
from mlmha_fairseq.data.multi_source_dataset import DataError, derangement
from mlmha_fairseq.evaluation.attention_statistics import recording_attention
from mlmha_fairseq.evaluation.multi_source_attention import record, recorded_attentions, sublayer_weights
from mlmha_fairseq.errors import UsageError
from mlmha_fairseq.models.multi_source import (
    ImageFeatureEncoder,
    MultiSourceHubInterface,
    MultiSourceTransformerModel,
    combination_modules,
)
from mlmha_fairseq.modules.input_combination import COMBINATIONS, STRATEGIES, build_input_combination
from mlmha_fairseq.tasks.multi_source_translation import MultiSourceTranslationTask

D, DECODER_LAYERS, CHANNELS, POSITIONS = 16, 2, 6, 3
SPLITS = N_WAY_SPLITS


def multi_source_args(sources, *extra, image_sources=()):
    """fairseq-train's options of a tiny multi-source model."""
    return options.parse_args_and_arch(options.get_training_parser(), [
        "unused-data-dir", "--task", "multi_source_translation", "--user-dir", USER_DIR,
        "--arch", "multi_source_transformer", *TINY_MODEL_ARGS, "--source-langs", ",".join(sources),
        "--target-lang", "tgt", *(["--image-sources", ",".join(image_sources)] if image_sources else []),
        *map(str, extra),
    ])


def build_multi_source(sources, *extra, image_sources=(), dictionary=None, args=None):
    """A tiny multi-source model and its task, built as fairseq-train builds them (the
    task gets the toy dictionary instead of reading a data directory); ``args``: options
    of :func:`multi_source_args` to build from instead."""
    args = args or multi_source_args(sources, *extra, image_sources=image_sources)
    task = MultiSourceTranslationTask(args, dictionary or toy_dictionary(),
                                      {name: CHANNELS for name in image_sources})
    return task.build_model(args), task


def multi_source_batch(dictionary, kinds, batch_size=4, seed=0):
    """One input per source (text of different lengths, left-padded; or image features)
    and the decoder input."""
    inputs, lengths = [], []
    prev = None
    for k, kind in enumerate(kinds):
        if kind == "image":
            gen = torch.Generator().manual_seed(seed + k)
            inputs.append(torch.randn(batch_size, POSITIONS, CHANNELS, generator=gen))
            lengths.append(torch.full((batch_size,), POSITIONS))
            continue
        src, length, batch_prev = random_batch(dictionary, batch_size, src_len=7 - 2 * (k % 2), seed=seed + k)
        prev = batch_prev if prev is None else prev
        inputs.append(src)
        lengths.append(length)
    return inputs, lengths, prev


def forward(model, inputs, lengths, prev, primary=0, **kwargs):
    return model(inputs[primary], lengths[primary], prev, multi_source_inputs=inputs,
                 multi_source_lengths=lengths, **kwargs)


def net_input_batch(inputs, lengths, prev, primary=0):
    """The batch of :func:`forward`'s call, as the task collates it (for ``record``)."""
    return {"net_input": dict(src_tokens=inputs[primary], src_lengths=lengths[primary],
                              prev_output_tokens=prev, multi_source_inputs=inputs,
                              multi_source_lengths=lengths)}


def reordered(tensors, order):
    return [t.index_select(0, order) for t in tensors]


# --- equivalence with fairseq's transformer -------------------------------------------

def renamed_state(reference, num_encoders=1, num_attentions=1):
    """fairseq's state dict, renamed for a multi-source model: the encoder becomes encoders
    0..num_encoders-1, each decoder layer's cross-attention becomes the combination's
    attentions 0..num_attentions-1 and its LayerNorm the combination's LayerNorm 0."""
    state = {}
    for key, value in reference.state_dict().items():
        key = key.replace(".encoder_attn_layer_norm.", ".encoder_attn.layer_norms.0.")
        if key.startswith("encoder."):
            state.update({key.replace("encoder.", f"encoder.encoders.{k}.", 1): value for k in range(num_encoders)})
        elif ".encoder_attn." in key and ".layer_norms." not in key:
            state.update({key.replace(".encoder_attn.", f".encoder_attn.attentions.{k}."): value
                          for k in range(num_attentions)})
        else:
            state[key] = value
    return state


@pytest.mark.parametrize("strategy", ["serial", "parallel", "flat"])
@NORMS
def test_one_source_equals_fairseq_transformer_with_its_weights(strategy, norm):
    """Libovický et al. 2018, §3: with n = 1 serial, parallel and flat are the standard decoder;
    the model's forward also takes fairseq's ``features_only``, ``alignment_layer`` and
    ``alignment_heads`` as fairseq's transformer does."""
    dictionary = toy_dictionary()
    reference = build_model("transformer", *norm, dictionary=dictionary).eval()
    model, _ = build_multi_source(["src"], "--combination-strategy", strategy, *norm, dictionary=dictionary)
    model.load_state_dict(renamed_state(reference), strict=True)
    model.eval()
    src, lengths, prev = random_batch(dictionary)
    options_ = dict(features_only=True, alignment_layer=0, alignment_heads=1)
    with torch.no_grad():
        expected, expected_extra = reference(src, lengths, prev)
        got, got_extra = forward(model, [src], [lengths], prev)
        expected_features, expected_features_extra = reference(src, lengths, prev, **options_)
        got_features, got_features_extra = forward(model, [src], [lengths], prev, **options_)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_extra["attn"][0], expected_extra["attn"][0], atol=1e-5, rtol=1e-5)
    assert got_features.shape == (*prev.shape, D)
    torch.testing.assert_close(got_features, expected_features, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_features_extra["attn"][0], expected_features_extra["attn"][0],
                               atol=1e-5, rtol=1e-5)


def test_hierarchical_second_level_is_certain_with_one_source():
    """Libovický et al. 2018, Eq. 8: with n = 1 the softmax over one context is 1 (so hierarchical is not the
    standard decoder, but a linear map of the context)."""
    dictionary = toy_dictionary()
    model, _ = build_multi_source(["src"], "--combination-strategy", "hierarchical", dictionary=dictionary)
    model.eval()
    src, lengths, prev = random_batch(dictionary)
    for layer in record(model, net_input_batch([src], [lengths], prev)):
        torch.testing.assert_close(layer["contexts"], torch.ones(4, prev.size(1), 1))


# --- the sublayer equations of Libovický et al. 2018 (Eqs. 3-8), written out -----------------------------------

def spec_equation(module, x, memories, masks, pre):
    """u of Libovický et al. 2018, §3, for ``module``'s strategy, computed from its own submodules, with the
    hierarchical second level position by position; ``pre``: pre-norm (the reference implementation)
    or post-norm, as the test asked for (not read from the module)."""
    norm = lambda y, k=0: module.layer_norms[k](y)  # noqa: E731

    def attend(attention, query, memory, mask=None):
        return attention(query=query, key=memory, value=memory, key_padding_mask=mask)[0]

    if module.strategy == "serial":
        h = x
        for k, (memory, mask) in enumerate(zip(memories, masks)):
            h = h + attend(module.attentions[k], norm(h, k), memory, mask) if pre else \
                norm(h + attend(module.attentions[k], h, memory, mask), k)
        return h
    q = norm(x) if pre else x
    if module.strategy == "parallel":
        u = x + sum(attend(a, q, m, mask) for a, m, mask in zip(module.attentions, memories, masks))
    elif module.strategy == "flat":
        u = x + attend(module.attentions[0], q, torch.cat(memories), torch.cat(masks, dim=1))
    else:
        contexts = [attend(a, q, m, mask) for a, m, mask in zip(module.attentions, memories, masks)]
        u = x.clone()
        for t in range(x.size(0)):
            for b in range(x.size(1)):
                states = torch.stack([c[t, b] for c in contexts])[:, None]  # n x 1 x C
                u[t, b] += attend(module.hier_attention, q[t, b][None, None], states)[0, 0]
    return u if pre else norm(u)


M = 12  # width of the encoder outputs (memory_dim), unlike the decoder's D


def sublayer_inputs(seed=0):
    """x (T x B x D), three memories (S_k x B x M, S_k = 4, 6, 3) and their B x S_k masks, one
    sentence of source 2 left-padded; T, B, S_k, D and M all differ, so that a mixed-up size shows."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 2, D, generator=gen)
    memories = [torch.randn(length, 2, M, generator=gen) for length in (4, 6, 3)]
    masks = [torch.zeros(2, m.size(0), dtype=torch.bool) for m in memories]
    masks[1][0, :2] = True
    return x, memories, masks


def combination(strategy, pre_norm, dropout=0.0, **kwargs):
    """A three-source sublayer over memories of width M, in eval mode, LayerNorms made distinct
    (so that swapping them shows)."""
    torch.manual_seed(0)
    module = build_input_combination(strategy, D, 2, 3, M, dropout=dropout, attention_dropout=0.0,
                                     normalize_before=pre_norm,
                                     hier_heads=4 if strategy == "hierarchical" else None, **kwargs)
    with torch.no_grad():
        for layer_norm in module.layer_norms:
            layer_norm.weight.uniform_(0.5, 1.5), layer_norm.bias.uniform_(-0.5, 0.5)
    return module.eval()


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("pre_norm", [False, True], ids=["post-norm", "pre-norm"])
def test_sublayer_equals_the_equations_of_the_paper(strategy, pre_norm):
    module = combination(strategy, pre_norm, dropout=0.1)
    x, memories, masks = sublayer_inputs()
    with torch.no_grad():
        got, _ = module(x, memories, masks)
        torch.testing.assert_close(got, spec_equation(module, x, memories, masks, pre_norm), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("need_weights", [False, True])
def test_hierarchical_second_level_computes_no_weights_that_nobody_reads(need_weights):
    """The second-level attention's weights are never returned (fairseq's alignment output is the
    primary source's first-level weights) and the analyses record them through their own hook:
    the sublayer does not ask fairseq's attention for them, which would average them over heads
    for nothing at every training step."""
    module = combination("hierarchical", False)
    outputs = []
    module.hier_attention.register_forward_hook(lambda attention, inputs, output: outputs.append(output))
    x, memories, masks = sublayer_inputs()
    with torch.no_grad():
        _, primary = module(x, memories, masks, need_weights=need_weights)
    assert [weights for _, weights in outputs] == [None]
    assert (primary is not None) == need_weights


def head_weights(attention, query, memory, mask):
    """Libovický et al. 2018, Eqs. 1 and 3, the weights only: per head i,
    softmax(Q W_i^Q (K W_i^K)^T / sqrt(d_h)) written out from the attention's projection
    weights (fairseq's biases included), pads at -inf: H x B x T x S."""
    heads, head_dim = attention.num_heads, attention.head_dim
    (tgt_len, bsz, _), src_len = query.shape, memory.size(0)
    q = (query @ attention.q_proj.weight.T + attention.q_proj.bias).view(tgt_len, bsz, heads, head_dim)
    k = (memory @ attention.k_proj.weight.T + attention.k_proj.bias).view(src_len, bsz, heads, head_dim)
    energies = torch.einsum("tbhd,sbhd->hbts", q, k) / head_dim ** 0.5
    return energies.masked_fill(mask[None, :, None, :], float("-inf")).softmax(-1)


def source_head_weights(module, x, memories, masks, pre):
    """Per source k, the H x B x T x S_k weights of the sublayer over source k: queries
    LN_k(h_{k-1}) (serial; h_0 = x) or LN(x) (the others), without LN in post-norm; flat's one
    joint distribution over the concatenation (Eq. 6), split by source."""
    if module.strategy == "flat":
        query = module.layer_norms[0](x) if pre else x
        joint = head_weights(module.attentions[0], query, torch.cat(memories), torch.cat(masks, dim=1))
        return list(joint.split([memory.size(0) for memory in memories], dim=-1))
    weights = []
    for k, (memory, mask) in enumerate(zip(memories, masks)):
        if module.strategy == "serial":
            h = spec_equation(module, x, memories[:k], masks[:k], pre)  # h_{k-1}: the first k-1 sublayers
            query = module.layer_norms[k](h) if pre else h
        else:
            query = module.layer_norms[0](x) if pre else x
        weights.append(head_weights(module.attentions[k], query, memory, mask))
    return weights


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_weights_over_the_primary_source_are_returned_when_asked(strategy):
    """fairseq's convention for the alignment output: no weights unless asked; with
    ``need_weights`` the weights over the primary source (here the second) averaged over heads
    (B x T x S), with ``need_head_weights`` per head (H x B x T x S); flat's are its slice of the
    joint distribution."""
    module = combination(strategy, pre_norm=True, primary_index=1)
    x, memories, masks = sublayer_inputs()
    with torch.no_grad():
        expected = source_head_weights(module, x, memories, masks, pre=True)[1]
        unasked = module(x, memories, masks)[1]
        averaged = module(x, memories, masks, need_weights=True)[1]
        per_head = module(x, memories, masks, need_head_weights=True)[1]
    assert unasked is None
    assert averaged.shape == (2, 5, 6) and per_head.shape == (2, 2, 5, 6)
    torch.testing.assert_close(averaged, expected.mean(0), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(per_head, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_first_source_is_primary_by_default(strategy):
    torch.manual_seed(0)
    module = COMBINATIONS[strategy](D, 2, 3, M, 0.0, 0.0, False).eval()
    x, memories, masks = sublayer_inputs()
    with torch.no_grad():
        got = module(x, memories, masks, need_weights=True)[1]
        expected = source_head_weights(module, x, memories, masks, pre=False)[0].mean(0)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_recorded_weights_are_every_sources_head_average(strategy):
    """For the attention dumps (Libovický et al. 2018, Appendix A): forward hooks on the
    sublayer's attentions record at every call, whatever the caller asked, the weights over
    each source averaged over heads (B x T x S_k)."""
    module = combination(strategy, pre_norm=False)
    x, memories, masks = sublayer_inputs()
    with torch.no_grad():
        expected = [w.mean(0) for w in source_head_weights(module, x, memories, masks, pre=False)]
        for asked in ({}, {"need_weights": True}, {"need_head_weights": True}):
            with recording_attention(recorded_attentions(module)) as records:
                module(x, memories, masks, **asked)
            recorded = sublayer_weights(module, records, [m.size(0) for m in memories])["sources"]
            assert len(recorded) == 3, asked
            for got, want in zip(recorded, expected):
                torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5, msg=str(asked))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_hooks_record_the_weights_the_sublayer_returns_over_the_primary_source(strategy):
    """The attention dumps' forward hooks and fairseq's alignment output agree: in the same
    call, the recorded head-averaged weights over the primary source (here the second) are
    those the sublayer returns with ``need_weights``; in a whole model, every decoder layer's
    recorded weights are fairseq's alignment weights of that layer (``alignment_layer``). The
    flat strategy's one joint distribution, split per source (text tokens, image positions),
    sums to 1 over all sources together."""
    module = combination(strategy, pre_norm=True, primary_index=1)
    x, memories, masks = sublayer_inputs()
    with recording_attention(recorded_attentions(module)) as records, torch.no_grad():
        returned = module(x, memories, masks, need_weights=True)[1]
    recorded = sublayer_weights(module, records, [m.size(0) for m in memories])
    assert [w.shape for w in recorded["sources"]] == [(2, 5, length) for length in (4, 6, 3)]
    torch.testing.assert_close(recorded["sources"][1], returned)
    model, task = build_multi_source(["a", "b", "img"], "--primary-source", "b",
                                     "--combination-strategy", strategy, image_sources=("img",))
    model.eval()
    inputs, lengths, prev = multi_source_batch(task.dictionary, task.source_kinds)
    layers = record(model, net_input_batch(inputs, lengths, prev, primary=1))
    assert len(layers) == DECODER_LAYERS
    for index, layer in enumerate(layers):
        assert [w.shape for w in layer["sources"]] == [(4, prev.size(1), length) for length in (7, 5, POSITIONS)]
        assert ("contexts" in layer) == (strategy == "hierarchical")
        with torch.no_grad():
            attn = forward(model, inputs, lengths, prev, primary=1, alignment_layer=index)[1]["attn"][0]
        torch.testing.assert_close(layer["sources"][1], attn)
        if strategy == "flat":
            joint = torch.cat(layer["sources"], dim=-1).sum(dim=-1)
            torch.testing.assert_close(joint, torch.ones_like(joint))
    if strategy == "flat":
        joint = torch.cat(recorded["sources"], dim=-1).sum(dim=-1)
        torch.testing.assert_close(joint, torch.ones_like(joint))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_source_without_padding_mask_is_attended_in_full(strategy):
    """A source given no mask (None: no padding) is attended as with an all-False mask;
    flat fills in such a mask for its concatenation (Eqs. 5-6)."""
    module = combination(strategy, pre_norm=False)
    x, memories, masks = sublayer_inputs()
    unmasked = [None, masks[1], None]
    full = [torch.zeros_like(masks[0]), masks[1], torch.zeros_like(masks[2])]
    with torch.no_grad():
        got, weights = module(x, memories, unmasked, need_weights=True)
        torch.testing.assert_close(got, spec_equation(module, x, memories, full, False), atol=1e-5, rtol=1e-5)
        expected = source_head_weights(module, x, memories, full, pre=False)[0].mean(0)
    torch.testing.assert_close(weights, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_missing_memory_or_mask_is_refused_each_alone(strategy):
    """A sublayer built for n sources needs n memories and n masks: one too few of either,
    the other complete, is refused (not silently cut to the shorter list)."""
    module = combination(strategy, pre_norm=False)
    x, memories, masks = sublayer_inputs()
    for wrong_memories, wrong_masks, counts in ((memories[:2], masks, "2 memories and 3 masks"),
                                                (memories, masks[:2], "3 memories and 2 masks")):
        with pytest.raises(ValueError, match=f"built for 3 sources got {counts}"):
            module(x, wrong_memories, wrong_masks)


@pytest.mark.parametrize("primary_index", [-1, 3])
def test_primary_source_must_be_one_of_the_sources(primary_index):
    """The primary source (whose weights are fairseq's alignment output) is one of 0..n-1."""
    with pytest.raises(ValueError, match=f"primary source {primary_index} of 3 sources"):
        build_input_combination("serial", D, 2, 3, M, dropout=0.0, attention_dropout=0.0,
                                normalize_before=False, primary_index=primary_index)


def test_hierarchical_second_level_drops_weights_at_the_general_rate():
    """Libovický et al. 2018's reference implementation: the per-source attentions drop attention
    weights at --attention-dropout, the second level at the general dropout rate."""
    module = build_input_combination("hierarchical", D, 2, 3, M, dropout=0.3, attention_dropout=0.1,
                                     normalize_before=True)
    assert module.hier_attention.dropout_module.p == 0.3
    assert [attention.dropout_module.p for attention in module.attentions] == [0.1] * 3
    assert module.hier_attention.num_heads == 2  # hier_heads not given: --decoder-attention-heads


# --- incremental decoding, causality, reordering ------------------------------------

KINDS = {"text": (["a", "b", "c"], ()), "text+image": (["a", "img"], ("img",))}


def assert_multi_source_incremental_matches_full(model, task):
    """Step-by-step decoding with fairseq's incremental state equals the teacher-forced forward
    pass, also after a beam-search reordering (rows repeated, dropped, permuted) of every source
    and every cache (with multi-level supervision: the auxiliary memories and decoders' too)."""
    model.eval()
    inputs, lengths, prev = multi_source_batch(task.dictionary, task.source_kinds)
    order, reorder_step = torch.tensor([2, 0, 0, 3, 1]), 2
    with torch.no_grad():
        before = forward(model, inputs, lengths, prev)[0]
        after = forward(model, reordered(inputs, order), reordered(lengths, order), prev[order])[0]
        encoder_out = model.encoder(inputs[0], lengths[0], multi_source_inputs=inputs,
                                    multi_source_lengths=lengths)
        state, rows = {}, prev
        for step in range(prev.size(1)):
            if step == reorder_step:
                encoder_out = model.encoder.reorder_encoder_out(encoder_out, order)
                model.decoder.reorder_incremental_state_scripting(state, order)
                rows = prev[order]
            out = model.decoder(rows[:, : step + 1], encoder_out=encoder_out, incremental_state=state)[0]
            expected = (after if step >= reorder_step else before)[:, step : step + 1]
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5, msg=f"step {step}")


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("sources", KINDS, ids=list(KINDS))
@NORMS
def test_incremental_decoding_matches_full_forward_with_beam_reordering(strategy, sources, norm):
    names, images = KINDS[sources]
    model, task = build_multi_source(names, "--combination-strategy", strategy, *norm, image_sources=images)
    assert_multi_source_incremental_matches_full(model, task)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_source_is_projected_once_per_sentence_and_cached(strategy):
    """Incremental decoding: after the first step each per-source attention (flat: its one
    attention over the concatenation) holds the keys and values of its own source in the
    incremental state (B x H x S x d_h, projected as ``memory W^K + b``), and later steps reuse
    them instead of projecting the source again."""
    model, task = build_multi_source(["a", "b", "c"], "--combination-strategy", strategy)
    model.eval()
    inputs, lengths, prev = multi_source_batch(task.dictionary, task.source_kinds)
    attentions = [a for module in combination_modules(model) for a in module.attentions]
    calls = []
    for attention in attentions:
        attention.k_proj.register_forward_hook(lambda *_, a=attention: calls.append(a))
    with torch.no_grad():
        encoder_out = model.encoder(inputs[0], lengths[0], multi_source_inputs=inputs,
                                    multi_source_lengths=lengths)
        memories = encoder_out["multi_source_memories"]
        if strategy == "flat":
            memories = [torch.cat(memories)]
        state = {}
        model.decoder(prev[:, :1], encoder_out=encoder_out, incremental_state=state)
        for module in combination_modules(model):
            assert len(module.attentions) == len(memories)
            for attention, memory in zip(module.attentions, memories):
                cached = attention._get_input_buffer(state)
                shape = (memory.size(0), memory.size(1), attention.num_heads, attention.head_dim)
                for name, proj in (("prev_key", attention.k_proj), ("prev_value", attention.v_proj)):
                    expected = (memory @ proj.weight.T + proj.bias).view(shape).permute(1, 2, 0, 3)
                    torch.testing.assert_close(cached[name], expected, atol=1e-6, rtol=1e-5)
        for step in (2, 3):
            model.decoder(prev[:, :step], encoder_out=encoder_out, incremental_state=state)
    assert len(calls) == len(attentions) and set(map(id, calls)) == set(map(id, attentions))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_alignment_output_is_the_attention_over_the_primary_source(strategy):
    """fairseq's alignment output (``extra["attn"]``: the top layer's cross-attention weights,
    averaged over heads) is, with ``--primary-source b``, the weights over source b (5
    tokens, unlike a and c: 7), the same as the top sublayer's recorded weights over b."""
    model, task = build_multi_source(["a", "b", "c"], "--primary-source", "b",
                                     "--combination-strategy", strategy)
    model.eval()
    modules = combination_modules(model)
    assert [module.primary_index for module in modules] == [1] * DECODER_LAYERS
    inputs, lengths, prev = multi_source_batch(task.dictionary, task.source_kinds)
    with torch.no_grad():
        attn = forward(model, inputs, lengths, prev, primary=1)[1]["attn"][0]
    assert attn.shape == (4, prev.size(1), 5)
    torch.testing.assert_close(attn, record(model, net_input_batch(inputs, lengths, prev, primary=1))[-1]["sources"][1])


def test_layer_returns_cross_attention_weights_when_fairseqs_layer_does():
    """One source, fairseq's weights: the multi-source decoder layer returns the weights when
    the caller asks (``need_attn``) and, in eval mode, whenever its ``need_attn`` flag is on
    (fairseq's rule; ``make_generation_fast_`` turns the flag off), as fairseq's layer does."""
    dictionary = toy_dictionary()
    reference = build_model("transformer", "--dropout", "0", dictionary=dictionary)
    model, _ = build_multi_source(["src"], "--dropout", "0", dictionary=dictionary)
    model.load_state_dict(renamed_state(reference), strict=True)
    layer, reference_layer = model.decoder.layers[0], reference.decoder.layers[0]
    gen = torch.Generator().manual_seed(0)
    x, memory = torch.randn(5, 2, D, generator=gen), torch.randn(4, 2, D, generator=gen)
    mask = torch.tensor([[True, False, False, False], [False] * 4])
    cases = 0
    for training in (True, False):
        for flag in (True, False):
            for need_attn in (False, True):
                layer.train(training), reference_layer.train(training)
                layer.need_attn = reference_layer.need_attn = flag
                with torch.no_grad():
                    expected = reference_layer(x, memory, mask, need_attn=need_attn)[1]
                    got = layer(x, [memory], [mask], need_attn=need_attn)[1]
                case = f"training={training} flag={flag} need_attn={need_attn}"
                assert (got is None) == (expected is None), case
                if expected is not None:
                    cases += 1
                    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5, msg=case)
    assert cases == 5  # asked (4 cases) or eval mode with the flag on


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_future_target_tokens_do_not_change_earlier_positions(strategy):
    model, task = build_multi_source(["a", "b", "c"], "--combination-strategy", strategy)
    model.eval()
    inputs, lengths, prev = multi_source_batch(task.dictionary, task.source_kinds)
    changed = prev.clone()
    changed[:, 3:] = (changed[:, 3:] + 1 - task.dictionary.nspecial) % (
        len(task.dictionary) - task.dictionary.nspecial) + task.dictionary.nspecial
    with torch.no_grad():
        original = forward(model, inputs, lengths, prev)[0]
        modified = forward(model, inputs, lengths, changed)[0]
    torch.testing.assert_close(modified[:, :3], original[:, :3], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(modified[:, 3:], original[:, 3:])


def test_reordering_the_encoder_output_reorders_every_source():
    model, task = build_multi_source(["a", "b", "img"], image_sources=("img",))
    model.eval()
    inputs, lengths, _ = multi_source_batch(task.dictionary, task.source_kinds)
    order = torch.tensor([3, 1, 1, 0])
    with torch.no_grad():
        encoder_out = model.encoder(inputs[0], lengths[0], multi_source_inputs=inputs, multi_source_lengths=lengths)
        expected = model.encoder(inputs[0][order], lengths[0][order], multi_source_inputs=reordered(inputs, order),
                                 multi_source_lengths=reordered(lengths, order))
    got = model.encoder.reorder_encoder_out(encoder_out, order)
    for key in ("multi_source_memories", "multi_source_padding_masks", "encoder_out", "encoder_padding_mask"):
        assert len(got[key]) == len(expected[key])
        for got_tensor, expected_tensor in zip(got[key], expected[key]):
            torch.testing.assert_close(got_tensor, expected_tensor)
    assert len(got["multi_source_memories"]) == 3


def encode(model, inputs, lengths, **kwargs):
    return model.encoder(inputs[0], lengths[0], multi_source_inputs=inputs, **kwargs)


def test_encoder_returns_the_primary_sources_hidden_states_only_when_asked():
    """Like fairseq's encoder (whose generator calls it without ``return_all_hiddens``): no
    ``encoder_states`` by default; when asked, those of the primary source's encoder."""
    model, task = build_multi_source(["a", "b", "img"], "--primary-source", "b", image_sources=("img",))
    model.eval()
    inputs, lengths, _ = multi_source_batch(task.dictionary, task.source_kinds)
    with torch.no_grad():
        default = encode(model, inputs, lengths, multi_source_lengths=lengths)
        asked = encode(model, inputs, lengths, multi_source_lengths=lengths, return_all_hiddens=True)
        primary = model.encoder.encoders[1](inputs[1], src_lengths=lengths[1], return_all_hiddens=True)
    assert default["encoder_states"] == []
    assert len(asked["encoder_states"]) == len(primary["encoder_states"]) == 3 + 1  # embeddings, 3 layers
    for got, expected in zip(asked["encoder_states"], primary["encoder_states"]):
        assert got.shape == (5, 4, D)  # source b: 5 tokens
        torch.testing.assert_close(got, expected)


def test_encoder_needs_every_source_but_not_their_lengths():
    """The padding masks come from the tokens (fairseq's encoder reads no lengths), so
    ``multi_source_lengths`` may be left out; a missing or extra source is refused."""
    model, task = build_multi_source(["a", "b", "img"], image_sources=("img",))
    model.eval()
    inputs, lengths, _ = multi_source_batch(task.dictionary, task.source_kinds)
    with torch.no_grad():
        with_lengths = encode(model, inputs, lengths, multi_source_lengths=lengths)
        without = encode(model, inputs, lengths)
    for key in ("multi_source_memories", "multi_source_padding_masks"):
        assert len(without[key]) == 3
        for got, expected in zip(without[key], with_lengths[key]):
            torch.testing.assert_close(got, expected)
    for wrong in (inputs[:2], inputs + inputs[:1], None):
        with pytest.raises(ValueError, match=r"needs its 3 sources \(a,b,img\)"):
            model.encoder(inputs[0], lengths[0], multi_source_inputs=wrong)


def test_max_positions_are_the_text_encoders():
    """Image features have no position limit; the text encoders' is --max-source-positions."""
    model, _ = build_multi_source(["img", "a"], "--max-source-positions", "37", image_sources=("img",))
    assert model.encoder.max_positions() == 37


def test_image_encoder_projects_the_features_and_pads_no_position():
    """Libovický et al. 2018, §4: ``Linear(C, d)`` over the features, ``B x P x C -> P x B x d``;
    no position is padding: fairseq's boolean ``B x P`` mask, all False, made on the device
    of the features (checked on PyTorch's meta device, which refuses to mix with CPU tensors)."""
    torch.manual_seed(0)
    encoder = ImageFeatureEncoder(CHANNELS, D)
    features = torch.randn(4, POSITIONS, CHANNELS)
    out = encoder(features)
    expected = (features @ encoder.projection.weight.T + encoder.projection.bias).transpose(0, 1)
    torch.testing.assert_close(out["encoder_out"][0], expected)
    mask = out["encoder_padding_mask"][0]
    assert mask.dtype == torch.bool and mask.shape == (4, POSITIONS) and not mask.any()
    with torch.device("meta"):
        on_meta = ImageFeatureEncoder(CHANNELS, D)
    assert on_meta(torch.empty(4, POSITIONS, CHANNELS, device="meta"))["encoder_padding_mask"][0].is_meta


def test_cross_attention_keys_have_the_encoder_width():
    """With ``--encoder-embed-dim`` 12 and ``--decoder-embed-dim`` 16, every per-source
    attention projects keys and values from the encoders' width (Libovický et al. 2018, Eq. 3:
    ``K W_i^K`` with K an encoder state), the hierarchical second level from the contexts'
    (the decoder's): W^K and W^V are 16 x 12, resp. 16 x 16; and the model runs."""
    for strategy in STRATEGIES:
        model, task = build_multi_source(["a", "b"], "--encoder-embed-dim", "12",
                                         "--combination-strategy", strategy)
        model.eval()
        for module in combination_modules(model):
            for attention in module.attentions:
                assert attention.k_proj.weight.shape == attention.v_proj.weight.shape == (D, 12), strategy
            if strategy == "hierarchical":
                assert module.hier_attention.k_proj.weight.shape == (D, D)
        inputs, lengths, prev = multi_source_batch(task.dictionary, task.source_kinds)
        with torch.no_grad():
            assert forward(model, inputs, lengths, prev)[0].shape == (*prev.shape, len(task.dictionary))


def test_decoder_layer_selection_reaches_every_multi_source_layer():
    """Decoder self-attention mechanisms placed by layer (here ``--dc-decoder-layers 2``, the
    Dual Contextual module) see each multi-source decoder layer's own index: layer 2 only."""
    model, _ = build_multi_source(["a", "b"], "--dc-decoder-layers", "2")
    kinds = [type(layer.self_attn).__name__ for layer in model.decoder.layers]
    assert kinds == ["MultiheadAttention", "DualContextual"]


def test_encoder_is_a_fairseq_encoder_over_the_joint_dictionary():
    """``FairseqEncoder.dictionary``: the task's one joint dictionary, as fairseq's encoder keeps
    its source dictionary; so does every text encoder."""
    model, task = build_multi_source(["a", "img", "b"], image_sources=("img",))
    assert model.encoder.dictionary is task.source_dictionary
    text_encoders = [model.encoder.encoders[k] for k in (0, 2)]
    assert all(encoder.dictionary is task.source_dictionary for encoder in text_encoders)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_retained_dropout_can_name_the_combination(strategy):
    """fairseq's ``--retain-dropout --retain-dropout-modules NAME`` (dropout at inference for the
    modules of that class name) reaches the combination sublayer's dropout under its class
    name, and only under it."""
    name = COMBINATIONS[strategy].__name__
    for modules, expected in (([name], True), (["MultiheadAttention"], False)):
        model, _ = build_multi_source(["a", "b"], "--combination-strategy", strategy, "--dropout", "0.1")
        model.eval().make_generation_fast_(retain_dropout=True, retain_dropout_modules=modules)
        assert [m.dropout_module.apply_during_inference for m in combination_modules(model)] == \
            [expected] * DECODER_LAYERS, modules


def write_embeddings(path, dictionary, value):
    """fairseq's text embedding file (``--*-embed-path``): a header line, then ``word v_1 ... v_d``;
    word ``w{i}`` gets ``value + i`` in every dimension."""
    words = [w for w in dictionary.symbols if w.startswith("w")]
    path.write_text(f"{len(words)} {D}\n" + "".join(
        f"{w} {' '.join([str(value + int(w[1:]))] * D)}\n" for w in words))
    return {dictionary.index(w): value + int(w[1:]) for w in words}


def test_pretrained_embeddings_are_loaded_into_every_matrix(tmp_path):
    """``--encoder-embed-path`` fills every text encoder's matrix (the primary source's and the
    others', unshared), ``--decoder-embed-path`` the decoder's, as fairseq's transformer does."""
    dictionary = toy_dictionary()
    encoder_rows = write_embeddings(tmp_path / "encoder.txt", dictionary, 100.0)
    decoder_rows = write_embeddings(tmp_path / "decoder.txt", dictionary, -100.0)
    model, _ = build_multi_source(["a", "b"], "--primary-source", "b",
                                  "--encoder-embed-path", tmp_path / "encoder.txt",
                                  "--decoder-embed-path", tmp_path / "decoder.txt", dictionary=dictionary)
    matrices = [encoder.embed_tokens.weight for encoder in model.encoder.encoders]
    assert matrices[0] is not matrices[1]
    for weight, rows in ((matrices[0], encoder_rows), (matrices[1], encoder_rows),
                         (model.decoder.embed_tokens.weight, decoder_rows)):
        for index, value in rows.items():
            torch.testing.assert_close(weight[index], torch.full((D,), value))


def test_shared_embeddings_are_filled_from_the_encoder_embedding_file(tmp_path):
    """With ``--share-all-embeddings`` the one matrix is filled from ``--encoder-embed-path``,
    which ``--decoder-embed-path`` may repeat; another decoder file is refused at build time,
    since the decoder would not read it."""
    dictionary = toy_dictionary()
    rows = write_embeddings(tmp_path / "shared.txt", dictionary, 100.0)
    write_embeddings(tmp_path / "decoder.txt", dictionary, -100.0)
    shared = ["--share-all-embeddings", "--encoder-embed-path", tmp_path / "shared.txt"]
    model, _ = build_multi_source(["a", "b"], *shared, "--decoder-embed-path", tmp_path / "shared.txt",
                                  dictionary=dictionary)
    assert model.decoder.embed_tokens is model.encoder.encoders[0].embed_tokens
    for index, value in rows.items():
        torch.testing.assert_close(model.decoder.embed_tokens.weight[index], torch.full((D,), value))
    with pytest.raises(UsageError, match=re.escape(f"--decoder-embed-path {tmp_path / 'decoder.txt'}: with "
                                                   "--share-all-embeddings the decoder")):
        build_multi_source(["a", "b"], *shared, "--decoder-embed-path", tmp_path / "decoder.txt",
                           dictionary=dictionary)


def pruning_args(sources, encoder_keep, decoder_keep, *extra, image_sources=()):
    """The options of a model loaded with fairseq-generate's ``--model-overrides
    "{'encoder_layers_to_keep': '0,2', ...}"`` (strings, as the overrides give them)."""
    args = multi_source_args(sources, *extra, image_sources=image_sources)
    args.encoder_layers_to_keep, args.decoder_layers_to_keep = encoder_keep, decoder_keep
    return args


def test_layers_to_keep_prune_every_text_encoder_and_the_decoder_as_fairseq_loads_them():
    """The loaded model has the kept layers of every text encoder and of the decoder, with
    their weights (fairseq's load_state_dict prunes and renumbers them); the other weights
    are the whole model's."""
    sources, images = ["a", "b", "img"], ("img",)
    whole, _ = build_multi_source(sources, image_sources=images)
    args = pruning_args(sources, "0,2", "1", image_sources=images)
    pruned, _ = build_multi_source(sources, image_sources=images, args=args)
    pruned.load_state_dict(whole.state_dict(), strict=True, model_cfg=args)
    pairs = [(pruned.encoder.encoders[k].layers, whole.encoder.encoders[k].layers, [0, 2]) for k in (0, 1)]
    pairs.append((pruned.decoder.layers, whole.decoder.layers, [1]))
    for kept, layers, indices in pairs:
        assert len(kept) == len(indices)
        for layer, index in zip(kept, indices):
            for (name, weight), (_, expected) in zip(layer.state_dict().items(), layers[index].state_dict().items()):
                assert torch.equal(weight, expected), name
    for name, weight in pruned.state_dict().items():
        if ".layers." not in name:
            assert torch.equal(weight, whole.state_dict()[name]), name


@pytest.mark.parametrize("encoder_keep, decoder_keep, message", [
    ("0,3", None, "--encoder-layers-to-keep 0,3: name distinct layers among the 3 encoder layers (0 to 2) of "
                  "multi_source_transformer"),
    ("1,1", None, "--encoder-layers-to-keep 1,1: name distinct"),
    ("first", None, "--encoder-layers-to-keep first: name distinct"),
    (None, "2", "--decoder-layers-to-keep 2: name distinct layers among the 2 decoder layers"),
])
def test_layers_to_keep_name_layers_of_the_model(encoder_keep, decoder_keep, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        build_multi_source(["a", "b"], args=pruning_args(["a", "b"], encoder_keep, decoder_keep))


def test_pruning_is_refused_for_weights_sized_by_the_number_of_layers():
    """MLRF's layer table has one row per encoder layer: pruning could not load it."""
    whole, _ = build_multi_source(["a", "b"], "--mlrf-encoder-fusion", "fnn")
    args = pruning_args(["a", "b"], "0,2", None, "--mlrf-encoder-fusion", "fnn")
    pruned, _ = build_multi_source(["a", "b"], args=args)
    with pytest.raises(UsageError, match=r"--encoder-layers-to-keep: encoder\.encoders\.0\..* has a size per "
                                         r"number of layers"):
        pruned.load_state_dict(whole.state_dict(), strict=True, model_cfg=args)


def test_decoder_pruning_is_refused_for_decoder_weights_sized_by_the_number_of_layers():
    """MLRF's decoder fusion reads every decoder layer (its FFN input and its layer table have a
    size per layer): pruning the decoder alone is refused in one line naming the option, as
    pruning the encoders is."""
    whole, _ = build_multi_source(["a", "b"], "--mlrf-decoder-fusion", "fnn")
    args = pruning_args(["a", "b"], None, "1", "--mlrf-decoder-fusion", "fnn")
    pruned, _ = build_multi_source(["a", "b"], args=args)
    with pytest.raises(UsageError, match=r"--decoder-layers-to-keep: decoder\.output_fusion\..* has a size per "
                                         r"number of layers"):
        pruned.load_state_dict(whole.state_dict(), strict=True, model_cfg=args)


def test_layers_to_keep_in_args_prune_as_in_model_cfg():
    """fairseq's ``load_state_dict`` still takes the options as a Namespace (``args``, its
    deprecated form of ``model_cfg``): the kept layers are loaded, renumbered, just the same."""
    whole, _ = build_multi_source(["a", "b"])
    args = pruning_args(["a", "b"], "2", "1")
    pruned, _ = build_multi_source(["a", "b"], args=args)
    pruned.load_state_dict(whole.state_dict(), strict=True, args=args)
    pairs = [(pruned.encoder.encoders[k].layers, whole.encoder.encoders[k].layers[2]) for k in (0, 1)]
    pairs.append((pruned.decoder.layers, whole.decoder.layers[1]))
    for kept, expected in pairs:
        assert len(kept) == 1
        for (name, weight), (_, value) in zip(kept[0].state_dict().items(), expected.state_dict().items()):
            assert torch.equal(weight, value), name


def test_loading_weights_is_strict_unless_asked_otherwise():
    """As any torch module: a state dict that lacks a weight of the model is refused by default
    and with ``strict=True``; ``strict=False`` loads the weights it has and keeps the others."""
    torch.manual_seed(0)
    source, _ = build_multi_source(["a", "b"])
    torch.manual_seed(1)
    model, _ = build_multi_source(["a", "b"])
    missing = "decoder.layers.0.fc1.weight"
    state = {key: value for key, value in source.state_dict().items() if key != missing}
    kept = model.state_dict()[missing].clone()
    for strict in ({}, {"strict": True}):
        with pytest.raises(RuntimeError, match=re.escape(missing)):
            model.load_state_dict(state, **strict)
    model.load_state_dict(state, strict=False)
    loaded = model.state_dict()
    assert torch.equal(loaded[missing], kept) and not torch.equal(kept, source.state_dict()[missing])
    for key, value in state.items():
        assert torch.equal(loaded[key], value), key


@pytest.mark.parametrize("options_, message", [
    (["--encoder-layers-to-keep", "0,2"], "--encoder-layers-to-keep 0,2: multi_source_transformer keeps layers of "
                                          "a trained model when fairseq-generate or fairseq-interactive loads it"),
    (["--share-all-embeddings", "--encoder-embed-path", "enc.txt", "--decoder-embed-path", "dec.txt"],
     "--decoder-embed-path dec.txt: with --share-all-embeddings the decoder of multi_source_transformer"),
    (["--merge-src-tgt-embed"], "--merge-src-tgt-embed: multi_source_transformer has one joint dictionary"),
])
def test_options_the_multi_source_build_refuses_end_training_with_one_line(n_way_bin, tmp_path, options_, message):
    """fairseq's transformer options that the multi-source build does not honour (see
    tests above for those it does) stop fairseq-train before the first update."""
    result = run_fairseq("train", *train_args(n_way_bin, tmp_path, "multi_source_transformer",
                                              *task_options("s1,s2"), *options_), check=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert message in result.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "checkpoint_last.pt").exists()


# --- parameters and options ---------------------------------------------------------

def num_params(model):
    return sum(p.numel() for p in model.parameters())


def test_parameters_per_strategy_match_the_table_of_b2():
    """Per decoder layer and n sources, relative to flat (one attention, one LN): serial and
    parallel add n-1 attentions (4d^2 + 4d), serial n-1 LayerNorms (2d), hierarchical n
    attentions (n-1 per source + 1 second level)."""
    n, attention, layer_norm = 3, 4 * D * D + 4 * D, 2 * D
    counts = {s: num_params(build_multi_source(["a", "b", "c"], "--combination-strategy", s)[0]) for s in STRATEGIES}
    assert counts["parallel"] - counts["flat"] == DECODER_LAYERS * (n - 1) * attention
    assert counts["serial"] - counts["parallel"] == DECODER_LAYERS * (n - 1) * layer_norm
    assert counts["hierarchical"] - counts["parallel"] == DECODER_LAYERS * attention


def test_shared_embeddings_and_image_projection():
    """Libovický et al. 2018, §4: ``--share-all-embeddings`` ties one V x d matrix three ways
    (every text encoder, the decoder's input and its output layer);
    ``--share-encoder-embeddings`` ties the text encoders' only; otherwise each of the three
    text encoders, the decoder's input and its output layer owns one."""
    matrix = len(toy_dictionary()) * D
    separate = num_params(build_multi_source(["a", "b", "c"])[0])
    encoders_shared = num_params(build_multi_source(["a", "b", "c"], "--share-encoder-embeddings")[0])
    all_shared = num_params(build_multi_source(["a", "b", "c"], "--share-all-embeddings")[0])
    assert separate - encoders_shared == 2 * matrix  # b's and c's
    assert encoders_shared - all_shared == 2 * matrix  # the decoder's input and output matrices
    model, _ = build_multi_source(["a", "b", "img"], "--share-all-embeddings", image_sources=("img",))
    text_a, text_b, image = model.encoder.encoders
    assert text_a.embed_tokens is text_b.embed_tokens is model.decoder.embed_tokens
    assert model.decoder.output_projection.weight is model.decoder.embed_tokens.weight
    assert image.projection.weight.shape == (D, CHANNELS)


@pytest.mark.parametrize("options, message", [
    (["--combination-strategy", "serial", "--hier-attention-heads", "2"], "applies to"),
    (["--combination-strategy", "hierarchical", "--hier-attention-heads", "3"], "must divide"),
    (["--combination-strategy", "hierarchical", "--hier-attention-heads", "0"], "must divide"),
    (["--decoder-cross-attention", "multi-layer"], "claimed by several"),
])
def test_bad_model_options_fail_with_a_clear_message(options, message):
    with pytest.raises(ValueError, match=message):
        build_multi_source(["a", "b"], *options)


@pytest.mark.parametrize("heads", [1, 4, 16])
def test_hierarchical_heads_option(heads):
    """Any divisor of --decoder-embed-dim (16), one head included."""
    model, _ = build_multi_source(["a", "b"], "--combination-strategy", "hierarchical",
                                  "--hier-attention-heads", heads)
    assert all(m.hier_attention.num_heads == heads for m in combination_modules(model))


PRESETS = {
    "multimodal_transformer_multi30k": dict(encoder_embed_dim=512, decoder_attention_heads=16,
                                            decoder_ffn_embed_dim=4096, encoder_layers=6, decoder_layers=6),
    "multi_source_transformer_europarl": dict(encoder_embed_dim=256, decoder_attention_heads=8,
                                              decoder_ffn_embed_dim=2048, encoder_layers=4, decoder_layers=6),
}


@pytest.mark.parametrize("arch", PRESETS)
def test_presets_have_the_paper_sizes_and_settings(arch):
    args = argparse.Namespace()
    ARCH_CONFIG_REGISTRY[arch](args)
    for name, value in PRESETS[arch].items():
        assert getattr(args, name) == value, name
    assert args.encoder_attention_heads == args.decoder_attention_heads
    assert args.combination_strategy == "serial"
    assert args.encoder_normalize_before and args.decoder_normalize_before  # the reference implementation
    assert args.no_scale_embedding and args.share_all_embeddings  # Libovický et al. 2018, §4
    # examples/multi_source/README.md, "Presets against the documents" (tests/test_presets.py
    # checks the table; repeated here, in the selection of the mechanism tests)
    assert (args.dropout, args.attention_dropout) == (0.1, 0.0)
    model, _ = build_multi_source(["a", "b"], "--arch", arch)  # tiny sizes, preset settings
    assert model.decoder.layers[0].normalize_before and model.decoder.embed_scale == 1.0


@pytest.mark.parametrize("arch", PRESETS)
def test_presets_keep_the_settings_already_given(arch):
    """A preset fills in only what is missing: values from the command line (--dropout 0.3)
    or from a checkpoint's stored arguments, to which fairseq applies the architecture again
    when it loads the model, are kept."""
    given = dict(encoder_normalize_before=False, decoder_normalize_before=False, no_scale_embedding=False,
                 share_all_embeddings=False, dropout=0.3, attention_dropout=0.2)
    args = argparse.Namespace(**given)
    ARCH_CONFIG_REGISTRY[arch](args)
    assert {name: getattr(args, name) for name in given} == given


# --- adversarial evaluation ---------------------------------------------------------

@pytest.mark.parametrize("size", [2, 3, 16, 1000])
def test_derangement_has_no_fixed_point_and_is_reproducible(size):
    permutation = derangement(size, seed=1)
    assert sorted(permutation) == list(range(size))
    assert not np.any(permutation == np.arange(size))
    assert (permutation == derangement(size, seed=1)).all()


# --- data: a tiny N-way corpus, binarized by fairseq-preprocess -----------------------

def write_n_way_corpus(root, seed=0):
    """The two-source text of :func:`write_n_way_text` and image features (random,
    [N, positions, channels]) as a third source."""
    text = root / "text"
    text.mkdir()
    write_n_way_text(text, seed)
    for split, n in SPLITS:
        features = np.random.RandomState(seed).randn(n, POSITIONS, CHANNELS).astype(np.float32)
        np.save(root / f"{split}.img.npy", features)
    return text


@pytest.fixture(scope="module")
def n_way_bin(tmp_path_factory):
    root = tmp_path_factory.mktemp("n_way")
    text = write_n_way_corpus(root)
    binarize_n_way(text, root / "bin")
    for split, _ in SPLITS:
        shutil.copy(root / f"{split}.img.npy", root / "bin" / f"{split}.img.npy")
    return root / "bin"


def setup_task(data, sources="s1,s2", *extra):
    args = options.parse_args_and_arch(options.get_training_parser(), [
        str(data), "--task", "multi_source_translation", "--user-dir", USER_DIR,
        "--arch", "multi_source_transformer", "--source-langs", sources, "--target-lang", "tgt", *extra,
    ])
    return MultiSourceTranslationTask.setup_task(args)


def test_loaded_tuples_stay_aligned(n_way_bin):
    task = setup_task(n_way_bin, "s1,s2,img", "--image-sources", "img", "--primary-source", "s2")
    task.load_dataset("valid")
    dataset = task.dataset("valid")
    dictionary = task.dictionary
    batch = dataset.collater([dataset[i] for i in (0, 5, 3)])
    s1, s2, image = batch["net_input"]["multi_source_inputs"]
    assert batch["net_input"]["src_tokens"] is s2
    assert image.shape == (3, POSITIONS, CHANNELS)
    def words(tokens):
        return dictionary.string(tokens[tokens.ne(dictionary.pad())]).split()

    for row in range(3):
        assert words(s2[row]) == [w.upper() for w in words(s1[row])]
        assert words(batch["target"][row]) == list(reversed(words(s1[row])))
    kept, ignored = dataset.filter_indices_by_size(np.arange(len(dataset)), (6, 1024))
    assert len(kept) + len(ignored) == len(dataset) and ignored
    assert all(max(dataset[i]["sources"][0].numel(), dataset[i]["sources"][1].numel()) <= 6 for i in kept)


def test_adversarial_source_is_a_derangement_of_that_source_only(n_way_bin):
    clean = setup_task(n_way_bin)
    adversarial = setup_task(n_way_bin, "s1,s2", "--adversarial-source", "s1", "--adversarial-seed", "3")
    clean.load_dataset("test"), adversarial.load_dataset("test")
    permutation = derangement(16, seed=3)
    for i in range(16):
        clean_item, item = clean.dataset("test")[i], adversarial.dataset("test")[i]
        assert torch.equal(item["sources"][0], clean.dataset("test")[int(permutation[i])]["sources"][0])
        assert torch.equal(item["sources"][1], clean_item["sources"][1])
        assert torch.equal(item["target"], clean_item["target"])


def corrupted_copy(n_way_bin, tmp_path):
    data = tmp_path / "bin"
    shutil.copytree(n_way_bin, data)
    return data


def test_source_files_with_different_line_counts(n_way_bin, tmp_path):
    data = corrupted_copy(n_way_bin, tmp_path)
    for suffix in ("bin", "idx"):  # train's s2 side (200 lines) as the test split's (16)
        shutil.copy(data / f"train.s2-tgt.s2.{suffix}", data / f"test.s2-tgt.s2.{suffix}")
    task = setup_task(data)
    with pytest.raises(DataError, match=r"test\.s2-tgt\.s2\.bin has 200 sentences .* has 16"):
        task.load_dataset("test")


def test_missing_language(n_way_bin, tmp_path):
    with pytest.raises(DataError, match=r"dict\.de\.txt not found"):
        setup_task(n_way_bin, "s1,de")
    data = corrupted_copy(n_way_bin, tmp_path)
    for suffix in ("bin", "idx"):
        (data / f"valid.s2-tgt.s2.{suffix}").unlink()
    with pytest.raises(DataError, match=r"source s2 of split 'valid': .*valid\.s2-tgt\.s2\.bin not found"):
        setup_task(data).load_dataset("valid")


def test_image_features_with_the_wrong_number_of_rows(n_way_bin, tmp_path):
    data = corrupted_copy(n_way_bin, tmp_path)
    np.save(data / "valid.img.npy", np.zeros((15, POSITIONS, CHANNELS), dtype=np.float32))
    task = setup_task(data, "s1,img", "--image-sources", "img")
    with pytest.raises(DataError, match=r"valid\.img\.npy has 15 rows .* has 16"):
        task.load_dataset("valid")


def test_training_stops_before_the_first_update_on_misaligned_data(n_way_bin, tmp_path):
    data = corrupted_copy(n_way_bin, tmp_path)
    np.save(data / "valid.img.npy", np.zeros((15, POSITIONS, CHANNELS), dtype=np.float32))
    result = run_fairseq("train", *train_args(data, tmp_path / "ckpt", "multi_source_transformer",
                                              *task_options("s1,img", "--image-sources", "img")), check=False)
    assert result.returncode != 0
    assert "valid.img.npy has 15 rows" in result.stderr
    assert not (tmp_path / "ckpt" / "checkpoint_last.pt").exists()


# --- the hub interface (from_pretrained) ----------------------------------------------------

def saved_multi_source_model(checkpoint, data, dictionary, sources=("s1", "s2")):
    """A tiny multi-source model saved as fairseq's trainer saves it (``checkpoint``), and the
    dictionaries of its task in ``data``; returns the model."""
    data.mkdir(exist_ok=True)
    for lang in (*sources, "tgt"):
        dictionary.save(str(data / f"dict.{lang}.txt"))
    args = multi_source_args(list(sources))
    model, _ = build_multi_source(list(sources), args=args, dictionary=dictionary)
    checkpoint.parent.mkdir(exist_ok=True)
    save_checkpoint(checkpoint, convert_namespace_to_omegaconf(args), model)
    return model


def test_from_pretrained_reads_model_pt_and_the_dictionaries_beside_it(tmp_path):
    """``from_pretrained(directory)``: the checkpoint ``model.pt`` and the data (dictionaries) of
    that directory, as fairseq's hub reads a model archive; the hub's model has the saved weights,
    and its ``encode`` turns a line of tab-separated sources into the packed row of their token
    ids (each source ended by EOS, the primary source first)."""
    dictionary = toy_dictionary()
    model = saved_multi_source_model(tmp_path / "model.pt", tmp_path, dictionary)
    hub = MultiSourceTransformerModel.from_pretrained(str(tmp_path))
    assert isinstance(hub, MultiSourceHubInterface)
    loaded = hub.models[0].state_dict()
    assert loaded.keys() == model.state_dict().keys()
    for key, value in model.state_dict().items():
        assert torch.equal(loaded[key], value), key
    ids = [dictionary.index(w) for w in ("w1", "w2")] + [dictionary.eos(), dictionary.index("w3"), dictionary.eos()]
    assert hub.encode("w1 w2\tw3").tolist() == ids


def test_hub_interface_encodes_with_its_bpe_and_decodes_as_the_saved_model(tmp_path):
    """``from_pretrained(models, checkpoint, data, **overrides)``: the data directory is the one
    given, the overrides reach the hub (here ``bpe="characters"``, so ``encode`` splits every
    source into characters), and generation scores the line as the model that was saved does."""
    space = "\u2581"  # fairseq's characters BPE writes a space as this symbol
    dictionary = toy_dictionary([*VOCAB, "a", "b", "c", space])
    model = saved_multi_source_model(tmp_path / "models" / "checkpoint_best.pt", tmp_path / "data", dictionary)
    hub = MultiSourceTransformerModel.from_pretrained(str(tmp_path / "models"), "checkpoint_best.pt",
                                                      str(tmp_path / "data"), bpe="characters")
    line = "ab c\tc a"
    row = hub.encode(line)
    eos = dictionary.eos_word
    assert [dictionary[i] for i in row] == ["a", "b", space, "c", eos, "c", space, "a", eos]
    reference = MultiSourceHubInterface(hub.cfg, hub.task, [model])
    decoding = dict(beam=2, max_len_a=0, max_len_b=4)
    got, = hub.generate([row], **decoding)
    expected, = reference.generate([reference.encode(line)], **decoding)
    assert got[0]["tokens"].tolist() == expected[0]["tokens"].tolist()
    torch.testing.assert_close(got[0]["positional_scores"], expected[0]["positional_scores"])
    assert hub.translate(line, **decoding) == reference.translate(line, **decoding)


# --- command-line round trips -------------------------------------------------------

def task_options(sources, *extra):
    return ["--task", "multi_source_translation", "--source-langs", sources, "--target-lang", "tgt", *extra]


def assert_generates_the_test_set(data, checkpoint, *options):
    output = generate(data, checkpoint, "--required-batch-size-multiple", "1", *options)
    hypotheses, references = hypotheses_and_references(output)
    assert len(hypotheses) == len(references) == 16
    return output


def test_round_trip_two_text_sources(n_way_bin, tmp_path):
    options_ = task_options("s1,s2")
    run_fairseq("train", *train_args(n_way_bin, tmp_path, "multi_source_transformer_europarl", *options_,
                                     "--combination-strategy", "parallel"))
    assert_generates_the_test_set(n_way_bin, tmp_path / "checkpoint_last.pt", *options_, "--gnmt-lenpen", "1.0")


def test_checkpoint_activations_round_trip_serial(n_way_bin, tmp_path):
    """fairseq-train --checkpoint-activations (3 updates) -> fairseq-generate; the gradients
    of every architecture with and without it: tests/test_checkpoint_activations.py."""
    options_ = task_options("s1,s2,img", "--image-sources", "img")
    run_fairseq("train", *train_args(n_way_bin, tmp_path, "multi_source_transformer", *options_,
                                     "--combination-strategy", "serial", "--checkpoint-activations"))
    assert_generates_the_test_set(n_way_bin, tmp_path / "checkpoint_last.pt", *options_)


def test_round_trip_text_and_image_features_with_adversarial_images(n_way_bin, tmp_path):
    options_ = task_options("s1,img", "--image-sources", "img")
    run_fairseq("train", *train_args(n_way_bin, tmp_path, "multimodal_transformer_multi30k", *options_,
                                     "--combination-strategy", "hierarchical"))
    checkpoint = tmp_path / "checkpoint_last.pt"
    assert_generates_the_test_set(n_way_bin, checkpoint, *options_)
    assert_generates_the_test_set(n_way_bin, checkpoint, *options_, "--adversarial-source", "img")
    assert_attention_dump(n_way_bin, checkpoint, tmp_path / "dump")


def assert_attention_dump(data, checkpoint, out):
    """Per source, layers x target x source weights that sum to 1 over each source;
    second-level weights that sum to 1 over the sources; Figure 2 means; PNG heat maps."""
    multi_source_attention.main([str(checkpoint), "--data-bin", str(data), "--lines", "2", "5",
                                 "--max-sentences", "8", "--output-dir", str(out)])
    summary = json.loads((out / "attention.json").read_text())
    assert summary["strategy"] == "hierarchical" and summary["sources"] == ["s1", "img"]
    line = summary["lines"][1]
    data = np.load(out / "line5.npz")
    target, s1 = len(line["target"]), len(line["sources"]["s1"])
    assert data["source_s1"].shape == (DECODER_LAYERS, target, s1)
    assert data["source_img"].shape == (DECODER_LAYERS, target, POSITIONS)
    assert data["contexts"].shape == (DECODER_LAYERS, target, 2)
    for key in ("source_s1", "source_img", "contexts"):
        np.testing.assert_allclose(data[key].sum(-1), 1.0, rtol=1e-5)
    means = np.array(summary["context_weights"]["layers"])
    assert means.shape == (DECODER_LAYERS, 2) and summary["context_weights"]["sentences"] == 8
    np.testing.assert_allclose(means.sum(-1), 1.0, rtol=1e-5)
    for name in ("line2.png", "line5.png", "context_weights.png", "context_weights.csv"):
        assert (out / name).stat().st_size > 0


@pytest.mark.parametrize("strategy, scale", [("parallel", 2.0), ("flat", 1.0)])
def test_two_copies_of_one_source(strategy, scale):
    """Two identical sources with identical weights: parallel sums the two contexts
    (Eq. 4, not their mean), so it equals the standard decoder with a doubled
    cross-attention output; flat's joint softmax over duplicated keys gives the standard
    decoder's distribution."""
    dictionary = toy_dictionary()
    reference = build_model("transformer", dictionary=dictionary).eval()
    model, _ = build_multi_source(["a", "b"], "--combination-strategy", strategy, dictionary=dictionary)
    num_attentions = 2 if strategy == "parallel" else 1
    model.load_state_dict(renamed_state(reference, 2, num_attentions), strict=True)
    model.eval()
    with torch.no_grad():
        for layer in reference.decoder.layers:
            layer.encoder_attn.out_proj.weight.mul_(scale)
            layer.encoder_attn.out_proj.bias.mul_(scale)
    src, lengths, prev = random_batch(dictionary)
    with torch.no_grad():
        expected = reference(src, lengths, prev)[0]
        got = forward(model, [src, src], [lengths, lengths], prev)[0]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


# --- build from local values -----------------------------------------------------------

def test_build_model_writes_nothing_into_args():
    args = options.parse_args_and_arch(options.get_training_parser(), [
        "unused-data-dir", "--task", "multi_source_translation", "--user-dir", USER_DIR,
        "--arch", "multi_source_transformer", *TINY_MODEL_ARGS, "--source-langs", "a,img",
        "--target-lang", "tgt", "--image-sources", "img"])
    before = dict(vars(args))
    task = MultiSourceTranslationTask(args, toy_dictionary(), {"img": CHANNELS})
    model = task.build_model(args)
    assert vars(args) == before
    assert model.args is args  # kept, as fairseq's transformer keeps them (its trainer reads them)
    assert model.encoder.encoders[1].projection.in_features == CHANNELS


def test_each_text_encoder_owns_its_mlrf_table_and_the_decoder_shares_the_primary_one():
    model, _ = build_multi_source(["a", "b", "c"], "--primary-source", "b", "--mlrf-encoder-fusion", "sa",
                                  "--mlrf-decoder-fusion", "fnn")
    tables = [encoder.memories["mlrf_fusion"].layer_embedding for encoder in model.encoder.encoders]
    assert len({id(table) for table in tables}) == 3
    assert model.decoder.output_fusion.layer_embedding is tables[1]
    # the table is one parameter of the model: trained by both sides
    shared = [p for p in model.parameters() if p is tables[1].weight]
    assert len(shared) == 1
