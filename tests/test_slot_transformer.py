"""The slot model with every slot at its default is fairseq's transformer."""
import collections
import logging
import sys
import types

import pytest
import torch
from fairseq import options, tasks
from fairseq.models.transformer import TransformerEncoderBase
from omegaconf import OmegaConf

from fairseq_helpers import (
    ALIGNMENT_OPTIONS,
    PRE_NORM,
    TINY_MODEL_ARGS,
    USER_DIR,
    assert_features_match_with_alignment_options,
    assert_incremental_matches_full,
    build_model,
    random_batch,
    toy_dictionary,
)
from mlmha_fairseq.errors import UsageError
from mlmha_fairseq.models import slots
from mlmha_fairseq.models.slot_transformer import SlotTransformerModel, recorded_options

NORMALIZATION = {
    "post-norm": [],
    "pre-norm": PRE_NORM,
}


def fairseq_and_slot_model(*options):
    """fairseq's transformer and the slot model given the same options, the slot model with
    the transformer's weights, both in eval mode."""
    dictionary = toy_dictionary()
    torch.manual_seed(0)
    reference = build_model("transformer", *options, dictionary=dictionary).eval()
    ours = build_model("slot_transformer", *options, dictionary=dictionary).eval()
    ours.load_state_dict(reference.state_dict(), strict=True)
    return dictionary, reference, ours


@pytest.mark.parametrize("norm", NORMALIZATION)
@pytest.mark.parametrize("left_pad", [True, False])
def test_equals_fairseq_transformer_with_its_weights(norm, left_pad):
    dictionary = toy_dictionary()
    torch.manual_seed(0)
    reference = build_model("transformer", *NORMALIZATION[norm], "--share-all-embeddings", dictionary=dictionary)
    ours = build_model("slot_transformer", *NORMALIZATION[norm], "--share-all-embeddings", dictionary=dictionary)
    assert isinstance(ours, SlotTransformerModel)
    ours.load_state_dict(reference.state_dict(), strict=True)
    assert ours.state_dict().keys() == reference.state_dict().keys()
    reference.eval(), ours.eval()

    src, lengths, prev = random_batch(dictionary, left_pad=left_pad)
    with torch.no_grad():
        expected, expected_extra = reference(src, lengths, prev)
        got, got_extra = ours(src, lengths, prev)
    assert torch.equal(got, expected)
    assert torch.equal(got_extra["attn"][0], expected_extra["attn"][0])
    for got_state, expected_state in zip(got_extra["inner_states"], expected_extra["inner_states"]):
        assert torch.equal(got_state, expected_state)


@pytest.mark.parametrize("norm", NORMALIZATION)
def test_incremental_decoding_matches_full_forward(norm):
    dictionary = toy_dictionary()
    model = build_model("slot_transformer", *NORMALIZATION[norm], dictionary=dictionary)
    assert_incremental_matches_full(model, dictionary)


def test_slot_options_are_listed_with_their_choices():
    from fairseq import options

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(
        parser, ["data", "--user-dir", "mlmha_fairseq", "--arch", "slot_transformer"]
    )
    for slot in slots.SELECTABLE_SLOTS:
        assert getattr(args, slot.dest) == slots.DEFAULT
        assert slots.DEFAULT in slot.choices


def test_two_mechanisms_claiming_one_slot_is_an_error():
    """The message names the slot, the layer (1-based, as the options count layers) where
    the slot is built per layer, and both mechanisms."""
    slot = slots.Slot("test")
    slot.register("a")(lambda cfg, **ctx: torch.nn.Identity())
    slot.register("b")(lambda cfg, **ctx: torch.nn.Identity())
    with pytest.raises(ValueError, match=r"^the test slot of layer 2 is claimed by several mechanisms \(a, b\): choose one$"):
        slot.build(object(), layer_idx=1)
    with pytest.raises(ValueError, match=r"^the test slot is claimed by several mechanisms \(a, b\): choose one$"):
        slot.build(object(), num_layers=3)


@pytest.mark.parametrize("name", ["a", slots.DEFAULT])
def test_a_filler_name_is_registered_once_and_standard_is_fairseqs(name):
    """A second filler of one name would silently replace the first; ``standard`` names
    fairseq's own module, which no filler can be."""
    slot = slots.Slot("test")
    slot.register("a")(lambda cfg, **ctx: torch.nn.Identity())
    with pytest.raises(ValueError, match=f"^test: filler '{name}' registered twice$"):
        slot.register(name)(lambda cfg, **ctx: torch.nn.Identity())


def test_model_hooks_run_once_on_every_built_model_with_its_encoder_and_decoder(monkeypatch):
    calls = []
    monkeypatch.setattr(slots, "_MODEL_HOOKS", list(slots._MODEL_HOOKS))
    hook = slots.register_model_hook(lambda encoder, decoder: calls.append((encoder, decoder)))
    assert callable(hook)
    model = build_model("slot_transformer")
    assert len(calls) == 1 and calls[0][0] is model.encoder and calls[0][1] is model.decoder


def test_unclaimed_slot_keeps_fairseq_module():
    slot = slots.Slot("test", "--test-slot")
    slot.register("mine", selectable=True)(lambda cfg, **ctx: torch.nn.Identity())

    class Cfg:
        test_slot = "standard"

    assert slot.build(Cfg()) is None
    Cfg.test_slot = "mine"
    assert isinstance(slot.build(Cfg()), torch.nn.Identity)


def test_mechanisms_of_different_slots_compose():
    """Mixed encoder heads + a Dual Contextual decoder layer + MLMHA cross-attention + MLRF
    decoder-side fusion: one model, still exact under incremental decoding with beam
    reordering."""
    dictionary = toy_dictionary()
    model = build_model(
        "slot_transformer", "--encoder-self-attention", "mixed", "--dc-decoder-layers", "1",
        "--decoder-cross-attention", "multi-layer", "--mlmha-variant", "M-10",
        "--mlrf-decoder-fusion", "sa", dictionary=dictionary,
    )
    assert set(model.encoder.memories) == {"mlmha_taps"}
    assert_incremental_matches_full(model, dictionary)


def test_a_replaced_encoder_output_the_decoder_does_not_read_is_refused():
    with pytest.raises(ValueError, match="mlrf_fusion replaces the encoder output"):
        build_model("slot_transformer", "--mlrf-encoder-fusion", "fnn",
                    "--decoder-cross-attention", "multi-layer")


# --- the staged decoder layer -------------------------------------------------------------

def layer_config(norm, **settings):
    """The ``TransformerConfig`` of the tiny slot model."""
    from fairseq import options
    from fairseq.models.transformer import TransformerConfig

    from fairseq_helpers import TINY_MODEL_ARGS, USER_DIR

    args = options.parse_args_and_arch(options.get_training_parser(), [
        "unused-data-dir", "--task", "translation", "--user-dir", USER_DIR, "--arch", "slot_transformer",
        *TINY_MODEL_ARGS, *NORMALIZATION[norm]])
    vars(args).update(settings)  # fairseq's --scale-* settings have no legacy command-line option
    return TransformerConfig.from_namespace(args)


def layer_pair(norm, **settings):
    """fairseq's decoder layer and the staged slot layer with the same weights."""
    from fairseq.modules.transformer_layer import TransformerDecoderLayerBase

    from mlmha_fairseq.models.slot_transformer import SlotTransformerDecoderLayer

    cfg = layer_config(norm, **settings)
    torch.manual_seed(0)
    reference = TransformerDecoderLayerBase(cfg)
    ours = SlotTransformerDecoderLayer(cfg, layer_idx=0)
    ours.load_state_dict(reference.state_dict(), strict=True)
    assert ours.state_dict().keys() == reference.state_dict().keys()
    with torch.no_grad():  # non-trivial LayerNorm weights, also for the --scale-* modules
        for name, parameter in reference.named_parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    ours.load_state_dict(reference.state_dict())
    return reference.eval(), ours.eval()


def layer_inputs(batch=3, tgt_len=5, src_len=4, dim=16, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tgt_len, batch, dim, generator=gen)
    memory = torch.randn(src_len, batch, dim, generator=gen)
    padding = torch.zeros(batch, src_len, dtype=torch.bool)
    padding[1, :1] = True
    return x, memory, padding


SCALE_OPTIONS = {"plain": {}, "scaled": dict(scale_attn=True, scale_heads=True, scale_fc=True, scale_resids=True)}


@pytest.mark.parametrize("norm", NORMALIZATION)
@pytest.mark.parametrize("scale", SCALE_OPTIONS)
def test_staged_layer_equals_fairseq_decoder_layer(norm, scale):
    reference, ours = layer_pair(norm, **SCALE_OPTIONS[scale])
    assert (ours.attn_ln is not None) == (scale == "scaled")
    x, memory, padding = layer_inputs()
    future = torch.triu(torch.full((x.size(0), x.size(0)), float("-inf")), 1)
    with torch.no_grad():
        expected = reference(x, memory, padding, self_attn_mask=future, need_attn=True)
        got = ours(x, memory, padding, self_attn_mask=future, need_attn=True)
    assert torch.equal(got[0], expected[0])
    assert torch.equal(got[1], expected[1])
    assert got[2] is expected[2] is None


@pytest.mark.parametrize("norm", NORMALIZATION)
def test_staged_layer_equals_fairseq_decoder_layer_incrementally_with_reordering(norm):
    reference, ours = layer_pair(norm)
    x, memory, padding = layer_inputs()
    new_order = torch.tensor([2, 0, 0])
    states = {"reference": {}, "ours": {}}
    with torch.no_grad():
        for step in range(x.size(0)):
            if step == 2:  # a beam-search reordering in the middle of decoding
                x, memory, padding = x[:, new_order], memory[:, new_order], padding[new_order]
                for layer, state in ((reference, states["reference"]), (ours, states["ours"])):
                    layer.self_attn.reorder_incremental_state(state, new_order)
                    layer.encoder_attn.reorder_incremental_state(state, new_order)
            expected = reference(x[step:step + 1], memory, padding, states["reference"], need_attn=True)
            got = ours(x[step:step + 1], memory, padding, states["ours"], need_attn=True)
            assert torch.equal(got[0], expected[0]), f"step {step}"
            assert torch.equal(got[1], expected[1]), f"step {step}"


@pytest.mark.parametrize("norm", NORMALIZATION)
@pytest.mark.parametrize("return_fc", [False, True], ids=["x", "return-fc"])
@pytest.mark.parametrize("attn_mask", [False, True], ids=["no-mask", "attn-mask"])
def test_staged_encoder_layer_equals_fairseq_encoder_layer(norm, return_fc, attn_mask):
    """The encoder layer's two stages compute fairseq's ``TransformerEncoderLayerBase.forward``
    with the same weights: padding, fairseq's 0/1 attention mask, ``return_fc``."""
    from fairseq.modules.transformer_layer import TransformerEncoderLayerBase

    from mlmha_fairseq.models.slot_transformer import SlotTransformerEncoderLayer

    cfg = layer_config(norm)
    torch.manual_seed(0)
    reference = TransformerEncoderLayerBase(cfg, return_fc=return_fc)
    with torch.no_grad():  # non-trivial LayerNorm weights
        for parameter in reference.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    ours = SlotTransformerEncoderLayer(cfg, layer_idx=0, return_fc=return_fc)
    ours.load_state_dict(reference.state_dict(), strict=True)
    assert ours.state_dict().keys() == reference.state_dict().keys()
    reference.eval(), ours.eval()
    x, _, _ = layer_inputs()  # T x B x C
    padding = torch.zeros(x.size(1), x.size(0), dtype=torch.bool)
    padding[1, -2:] = True
    mask = torch.triu(torch.ones(x.size(0), x.size(0)), 1) if attn_mask else None
    with torch.no_grad():
        expected = reference(x, padding, attn_mask=mask)
        got = ours(x, padding, attn_mask=mask)
    if return_fc:
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    else:
        assert torch.equal(got, expected)


@pytest.fixture
def stage_slots(monkeypatch):
    """The layer stage slots, with the fillers a test registers removed after it."""
    for slot in (slots.DECODER_AFTER_SELF_ATTENTION, slots.DECODER_CROSS_ATTENTION_SUBLAYER,
                 slots.DECODER_FEED_FORWARD, slots.ENCODER_AFTER_SELF_ATTENTION, slots.ENCODER_FEED_FORWARD):
        monkeypatch.setattr(slot, "_fillers", dict(slot._fillers))


class Shift(torch.nn.Module):
    """A test module of the after-self-attention slot: adds the layer extra ``shift``. No
    parameters: the layer's state dict stays fairseq's."""

    layer_attribute = "shift"

    def after_self_attention(self, x, extras):
        return x + extras["shift"]


class Sublayer(torch.nn.Module):
    """A test module of the cross-attention sublayer and feed-forward slots."""

    def __init__(self, layer_attribute=None, dim=16):
        super().__init__()
        self.layer_attribute = layer_attribute
        self.bias = torch.nn.Parameter(torch.full((dim,), 0.25))

    def cross_attention_sublayer(self, x, encoder_out, encoder_padding_mask, incremental_state, extras,
                                 need_weights, need_head_weights):
        return x + self.bias + extras["shift"] * encoder_out.mean(), None

    def feed_forward(self, x):
        return 2 * x + self.bias


def test_staged_layer_passes_per_call_extras_to_the_step_after_self_attention(stage_slots):
    from mlmha_fairseq.models.slot_transformer import LayerInput

    slots.DECODER_AFTER_SELF_ATTENTION.register("test")(lambda cfg, **where: Shift())
    reference, shifted = layer_pair("post-norm")
    assert isinstance(shifted.shift, Shift)
    x, memory, padding = layer_inputs()
    shift = torch.full_like(x, 0.5)
    with torch.no_grad():
        got = shifted(x, LayerInput(memory, {"shift": shift}), padding)[0]
        # the same layer from its stages, the shift added between them by hand
        h = shifted.self_attention_stage(x, memory, padding, None, None, None, None)
        h, _ = shifted.cross_attention_stage(h + shift, memory, padding, None, None, False, False, {})
        expected = shifted.feed_forward_stage(h)
        plain = reference(x, memory, padding)[0]
    assert torch.equal(got, expected)
    assert not torch.allclose(got, plain, atol=1e-3)


def test_stage_slot_modules_run_in_their_stages_under_the_names_they_declare(stage_slots):
    """A filled cross-attention sublayer is the layer's ``encoder_attn`` (no
    ``encoder_attn_layer_norm``); a filled feed-forward stage drops fairseq's FFN modules."""
    from mlmha_fairseq.models.slot_transformer import LayerInput, SlotTransformerDecoderLayer

    slots.DECODER_AFTER_SELF_ATTENTION.register("test")(lambda cfg, **where: Shift())
    slots.DECODER_CROSS_ATTENTION_SUBLAYER.register("test")(lambda cfg, **where: Sublayer())
    slots.DECODER_FEED_FORWARD.register("test")(lambda cfg, **where: Sublayer("ffn"))
    layer = SlotTransformerDecoderLayer(layer_config("pre-norm"), layer_idx=0).eval()
    assert {key.split(".")[0] for key in layer.state_dict()} == {
        "self_attn", "self_attn_layer_norm", "encoder_attn", "ffn"}
    assert layer.encoder_attn_layer_norm is layer.fc1 is layer.fc2 is layer.final_layer_norm is None
    x, memory, padding = layer_inputs()
    shift = torch.full_like(x, 0.5)
    with torch.no_grad():
        got, attn, _ = layer(x, LayerInput(memory, {"shift": shift}), padding)
        h = layer.self_attention_stage(x, memory, padding, None, None, None, None) + shift
        expected = 2 * (h + layer.encoder_attn.bias + shift * memory.mean()) + layer.ffn.bias
    assert torch.equal(got, expected) and attn is None


@pytest.mark.parametrize("norm", NORMALIZATION)
def test_encoder_stage_slot_modules_run_in_their_stages_under_the_names_they_declare(stage_slots, norm):
    """The encoder layer's after-self-attention and feed-forward slots: the step between the
    sublayers gets no per-call extras; a filled feed-forward stage drops fairseq's FFN
    modules and gives no ``fc_result``; an empty one is fairseq's (the equivalence test above)."""
    from mlmha_fairseq.models.slot_transformer import SlotTransformerEncoderLayer

    class EncoderShift(torch.nn.Module):
        layer_attribute = "shift"

        def after_self_attention(self, x, extras):
            assert extras == {}
            return x + 0.5

    slots.ENCODER_AFTER_SELF_ATTENTION.register("test")(lambda cfg, **where: EncoderShift())
    slots.ENCODER_FEED_FORWARD.register("test")(lambda cfg, layer_idx, embed_dim: Sublayer("ffn", embed_dim))
    layer = SlotTransformerEncoderLayer(layer_config(norm), layer_idx=0, return_fc=True).eval()
    assert {key.split(".")[0] for key in layer.state_dict()} == {"self_attn", "self_attn_layer_norm", "ffn"}
    assert layer.fc1 is layer.fc2 is layer.final_layer_norm is None
    x, _, _ = layer_inputs()
    padding = torch.zeros(x.size(1), x.size(0), dtype=torch.bool)
    padding[1, -2:] = True
    with torch.no_grad():
        got, fc_result = layer(x, padding)
        expected = 2 * (layer.self_attention_stage(x, padding, None) + 0.5) + layer.ffn.bias
    assert torch.equal(got, expected) and fc_result is None


def test_two_fillers_of_an_encoder_stage_slot_are_refused_naming_both(stage_slots):
    for name in ("first", "second"):
        slots.ENCODER_FEED_FORWARD.register(name, given_by=lambda cfg, name=name: f"--{name}-ffn")(
            lambda cfg, layer_idx, embed_dim: Sublayer("ffn", embed_dim))
    with pytest.raises(UsageError, match=r"^the encoder feed-forward slot of layer 1 is claimed by several "
                                         r"mechanisms \(--first-ffn, --second-ffn\): choose one$"):
        build_model("slot_transformer")


def test_two_fillers_of_a_decoder_stage_slot_are_refused_naming_both(stage_slots):
    slots.DECODER_AFTER_SELF_ATTENTION.register("test", given_by=lambda cfg: "--test-shift")(
        lambda cfg, **where: Shift())
    with pytest.raises(UsageError, match=r"^the decoder after self-attention slot of layer 1 is claimed by "
                                         r"several mechanisms \(--aux-fusion, --test-shift\): choose one$"):
        build_model("ms_transformer", "--aux-decoder-layers", "1", "--aux-fusion")
    slots.DECODER_CROSS_ATTENTION_SUBLAYER.register("test", given_by=lambda cfg: "--test-sublayer")(
        lambda cfg, **where: Sublayer())
    with pytest.raises(UsageError, match=r"^the decoder cross-attention of layer 1 is claimed by several "
                                         r"mechanisms \(--decoder-cross-attention multi-layer, --test-sublayer\): "
                                         r"choose one$"):
        build_model("slot_transformer", "--decoder-cross-attention", "multi-layer")


@pytest.mark.parametrize("norm", NORMALIZATION)
def test_staged_layer_takes_fairseqs_prev_attention_states(norm):
    """fairseq's ``prev_self_attn_state`` ([key, value, key padding mask]) and
    ``prev_attn_state`` ([key, value]) arguments of a decoder layer seed the attention
    caches as in fairseq's layer: the same output and the same caches afterwards."""
    reference, ours = layer_pair(norm)
    x, memory, padding = layer_inputs()
    batch, heads, head_dim, past = x.size(1), reference.self_attn.num_heads, reference.self_attn.head_dim, 3
    gen = torch.Generator().manual_seed(2)
    past_padding = torch.zeros(batch, past, dtype=torch.bool)
    past_padding[0, 0] = past_padding[2, :2] = True
    self_state = [torch.randn(batch, heads, past, head_dim, generator=gen),
                  torch.randn(batch, heads, past, head_dim, generator=gen), past_padding]
    cross_state = [torch.randn(batch, heads, memory.size(0), head_dim, generator=gen),
                   torch.randn(batch, heads, memory.size(0), head_dim, generator=gen)]
    step = x[:1]
    outputs, caches = [], []
    with torch.no_grad():
        for layer in (reference, ours):
            state = {}
            outputs.append(layer(step, memory, padding, state, prev_self_attn_state=list(self_state),
                                 prev_attn_state=list(cross_state), need_attn=True))
            caches.append((layer.self_attn._get_input_buffer(state), layer.encoder_attn._get_input_buffer(state)))
        unseeded = ours(step, memory, padding, {}, need_attn=True)
    assert torch.equal(outputs[1][0], outputs[0][0]) and torch.equal(outputs[1][1], outputs[0][1])
    for got, expected in zip(caches[1], caches[0]):
        assert got.keys() == expected.keys()
        for key in expected:
            assert torch.equal(got[key], expected[key]), key
    assert not torch.allclose(outputs[1][0], unseeded[0], atol=1e-3)

@pytest.mark.parametrize("norm", NORMALIZATION)
@pytest.mark.parametrize("source_padding", [True, False], ids=["source-padding", "no-source-padding"])
def test_staged_layer_equals_fairseq_decoder_layer_with_cross_self_attention(norm, source_padding):
    """``--cross-self-attention``: the self-attention attends over [encoder output; prefix], its
    future mask and key padding mask extended over the source positions (zeros where fairseq
    has no source padding mask), as in fairseq's layer; incrementally the cached keys already
    hold the source, and each step's output equals the full pass'."""
    reference, ours = layer_pair(norm, cross_self_attention=True)
    x, memory, padding = layer_inputs()
    padding = padding if source_padding else None
    future = torch.triu(torch.full((x.size(0), x.size(0)), float("-inf")), 1)
    target_padding = torch.zeros(x.size(1), x.size(0), dtype=torch.bool)
    target_padding[2, -1] = True
    with torch.no_grad():
        expected = reference(x, memory, padding, self_attn_mask=future,
                             self_attn_padding_mask=target_padding, need_attn=True)
        got = ours(x, memory, padding, self_attn_mask=future, self_attn_padding_mask=target_padding,
                   need_attn=True)
        states = {"reference": {}, "ours": {}}
        for step in range(x.size(0)):
            step_expected = reference(x[step:step + 1], memory, padding, states["reference"])
            step_got = ours(x[step:step + 1], memory, padding, states["ours"])
            assert torch.equal(step_got[0], step_expected[0]), f"step {step}"
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    plain, _ = layer_pair(norm)  # the same weights without --cross-self-attention
    with torch.no_grad():
        separate = plain(x, memory, padding, self_attn_mask=future, self_attn_padding_mask=target_padding)
    assert ours.cross_self_attention and not torch.allclose(got[0], separate[0], atol=1e-3)


@pytest.mark.parametrize("offload", [False, True], ids=["checkpoint", "checkpoint-offload"])
def test_layers_are_wrapped_for_activation_checkpointing_as_fairseqs(offload):
    """``--checkpoint-activations`` (``--offload-activations``): every encoder and decoder
    layer is wrapped as fairseq's ``build_*_layer`` wraps it (the layer's forward replaced by
    fairseq's checkpointed forward, with the same offload flag), and the model still computes
    fairseq's transformer."""
    dictionary = toy_dictionary()
    flags = ["--checkpoint-activations"] + (["--offload-activations"] if offload else [])
    torch.manual_seed(0)
    reference = build_model("transformer", *flags, dictionary=dictionary)
    ours = build_model("slot_transformer", *flags, dictionary=dictionary)
    ours.load_state_dict(reference.state_dict())
    pairs = list(zip(ours.encoder.layers, reference.encoder.layers)) + list(
        zip(ours.decoder.layers, reference.decoder.layers))
    assert len(pairs) == 5
    for layer, fairseqs in pairs:
        assert hasattr(layer, "precheckpoint_forward")
        assert layer.forward.func is fairseqs.forward.func
        assert layer.forward.args[1] is fairseqs.forward.args[1] is offload
    reference.train(), ours.train()  # checkpointing only applies with gradients
    src, lengths, prev = random_batch(dictionary)
    torch.manual_seed(1)
    expected = reference(src, lengths, prev)[0]
    torch.manual_seed(1)
    got = ours(src, lengths, prev)[0]
    torch.testing.assert_close(got, expected)


def test_reordering_selects_the_memory_entries_of_the_new_batch_rows():
    """``reorder_encoder_out``: fairseq's entries, plus every memory entry (here MLMHA's
    taps, K x T x B x C, and a T x B x C entry: the batch is the second dimension from the
    end) with its batch rows selected, equal to encoding the reordered batch, when the order
    changes the batch size; an order of the same size (beam search moving hypotheses among
    the beams of a sentence) keeps the memory entries as they are."""
    dictionary = toy_dictionary()
    model = build_model("slot_transformer", "--decoder-cross-attention", "multi-layer",
                        dictionary=dictionary).eval()
    src, lengths, _ = random_batch(dictionary)
    new_order = torch.tensor([2, 0, 0, 3, 1])
    with torch.no_grad():
        encoder_out = model.encoder(src, src_lengths=lengths)
        top = encoder_out["encoder_out"][0]  # T x B x C
        encoder_out["three_dims"] = [2 * top]
        fairseqs_keys = set(TransformerEncoderBase.reorder_encoder_out(model.encoder, encoder_out, new_order))
        reordered = model.encoder.reorder_encoder_out(encoder_out, new_order)
        expected = model.encoder(src[new_order], src_lengths=lengths[new_order])
        same_size = model.encoder.reorder_encoder_out(encoder_out, torch.tensor([1, 0, 3, 2]))
    assert set(reordered) == fairseqs_keys | {"mlmha_taps", "three_dims"} == set(same_size)
    assert len(reordered["mlmha_taps"]) == 1
    torch.testing.assert_close(reordered["mlmha_taps"][0], expected["mlmha_taps"][0])
    torch.testing.assert_close(reordered["encoder_out"][0], expected["encoder_out"][0])
    torch.testing.assert_close(reordered["three_dims"][0], 2 * expected["encoder_out"][0])
    assert same_size["mlmha_taps"] is encoder_out["mlmha_taps"]
    assert same_size["three_dims"] is encoder_out["three_dims"]


@ALIGNMENT_OPTIONS
def test_decoder_features_take_fairseqs_alignment_arguments(options):
    """``extract_features`` called directly (as alignment training and analysis tools do):
    its defaults and its alignment arguments mean what they mean in fairseq's decoder (the
    attention of layer ``alignment_layer`` averaged over its first ``alignment_heads`` heads;
    no future mask with ``full_context_alignment``)."""
    dictionary, reference, ours = fairseq_and_slot_model()
    src, lengths, prev = random_batch(dictionary)
    with torch.no_grad():
        encoder_out = reference.encoder(src, src_lengths=lengths)
    assert_features_match_with_alignment_options(reference.decoder, ours.decoder, prev, encoder_out, options)


@pytest.mark.parametrize("norm", NORMALIZATION)
def test_without_cross_attention_equals_fairseq_transformer(norm):
    """``--no-cross-attention``: decoder layers without encoder-decoder attention, as fairseq's."""
    dictionary, reference, ours = fairseq_and_slot_model("--no-cross-attention", *NORMALIZATION[norm])
    assert all(layer.encoder_attn is None for layer in ours.decoder.layers)
    src, lengths, prev = random_batch(dictionary)
    with torch.no_grad():
        assert torch.equal(ours(src, lengths, prev)[0], reference(src, lengths, prev)[0])


@pytest.mark.parametrize("return_all_hiddens", [None, False, True], ids=["default", "False", "True"])
def test_encoder_with_memories_returns_layer_states_only_when_asked(return_all_hiddens):
    """A filled memory slot makes the encoder collect every layer's output, but
    ``encoder_states`` is returned only when the caller asks, as fairseq's encoder does:
    then [embedding, layer 1..L], equal to fairseq's."""
    dictionary = toy_dictionary()
    torch.manual_seed(0)
    reference = build_model("transformer", dictionary=dictionary).eval()
    ours = build_model("slot_transformer", "--decoder-cross-attention", "multi-layer", dictionary=dictionary).eval()
    missing, unexpected = ours.encoder.load_state_dict(reference.encoder.state_dict(), strict=False)
    assert unexpected == [] and all(key.startswith("memories.") for key in missing)
    src, lengths, _ = random_batch(dictionary)
    asked = {} if return_all_hiddens is None else {"return_all_hiddens": return_all_hiddens}
    with torch.no_grad():
        expected = reference.encoder(src, src_lengths=lengths, **asked)
        got = ours.encoder(src, src_lengths=lengths, **asked)
    assert len(got["encoder_states"]) == len(expected["encoder_states"]) == (4 if return_all_hiddens else 0)
    for state, expected_state in zip(got["encoder_states"], expected["encoder_states"]):
        assert torch.equal(state, expected_state)
    assert got["fc_results"] == expected["fc_results"] and "mlmha_taps" in got


class TopLayer(torch.nn.Module):
    """A decoder-output fusion that keeps the top layer of ``[embedding, layer 1..L]``."""

    def forward(self, inner_states):
        return inner_states[-1]


@pytest.mark.parametrize("norm", NORMALIZATION)
def test_fused_decoder_output_is_finished_as_fairseq_finishes_the_top_layer(norm):
    """The decoder-output slot replaces the top layer's output only: the fused states then go
    through fairseq's final LayerNorm (pre-norm), to B x T x C and through the projection to
    ``--decoder-output-dim``. With a fusion that returns the top layer, the decoder is
    fairseq's."""
    sizes = ["--decoder-output-dim", "8", *NORMALIZATION[norm]]
    dictionary, reference, ours = fairseq_and_slot_model(*sizes)
    assert ours.decoder.output_fusion is None and ours.decoder.project_out_dim is not None
    ours.decoder.output_fusion = TopLayer()
    src, lengths, prev = random_batch(dictionary)
    with torch.no_grad():
        expected, expected_extra = reference(src, lengths, prev, features_only=True)
        got, got_extra = ours(src, lengths, prev, features_only=True)
    assert got.shape == (4, 6, 8) and torch.equal(got, expected)
    assert len(got_extra["inner_states"]) == len(expected_extra["inner_states"]) == 3


def test_without_an_encoder_output_the_decoder_skips_cross_attention_whatever_it_attends_to():
    """fairseq's decoder runs without an encoder output (``encoder_out=None``: every layer
    skips its cross-attention); so does a decoder whose cross-attention attends to another
    entry (MLMHA's taps): the result of the standard decoder with the same other weights."""
    dictionary = toy_dictionary()
    torch.manual_seed(0)
    standard = build_model("slot_transformer", dictionary=dictionary).eval()
    mlmha = build_model("slot_transformer", "--decoder-cross-attention", "multi-layer", dictionary=dictionary).eval()
    assert mlmha.decoder.memory_key == "mlmha_taps"
    shared = {k: v for k, v in standard.decoder.state_dict().items() if ".encoder_attn." not in k}
    missing, unexpected = mlmha.decoder.load_state_dict(shared, strict=False)
    assert unexpected == [] and all(".encoder_attn." in key for key in missing)
    _, _, prev = random_batch(dictionary)
    with torch.no_grad():
        expected = standard.decoder(prev, encoder_out=None)[0]
        got = mlmha.decoder(prev, encoder_out=None)[0]
    assert torch.equal(got, expected)


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("layer_need_attn", [True, False], ids=["layer-default", "generation-fast"])
def test_staged_layer_returns_attention_weights_when_fairseqs_layer_does(training, layer_need_attn):
    """The cross-attention weights come back when the call asks (``need_attn``) or, at
    inference, when the layer keeps its ``need_attn`` flag (fairseq's default, turned off by
    ``make_generation_fast_``): as in fairseq's layer, in training and eval mode, with the
    default call arguments too."""
    reference, ours = layer_pair("post-norm")
    x, memory, padding = layer_inputs()
    for layer in (reference, ours):
        layer.train(training)
        layer.need_attn = layer_need_attn
    for need_attn in (None, False, True):
        kwargs = {} if need_attn is None else {"need_attn": need_attn}
        with torch.no_grad():
            torch.manual_seed(4)
            expected = reference(x, memory, padding, **kwargs)
            torch.manual_seed(4)
            got = ours(x, memory, padding, **kwargs)
        assert torch.equal(got[0], expected[0])
        returned = bool(need_attn) or (not training and layer_need_attn)
        assert (got[1] is None) == (expected[1] is None) == (not returned), kwargs
        if returned:
            assert torch.equal(got[1], expected[1])


def test_per_layer_inputs_without_an_encoder_output_are_refused():
    """Per-layer extras travel with the encoder output to the layers: without one (None or
    an empty entry) the decoder refuses them with a clear message."""
    dictionary = toy_dictionary()
    model = build_model("slot_transformer", dictionary=dictionary).eval()
    src, lengths, prev = random_batch(dictionary)
    extras = {"shift": torch.zeros(prev.size(1), prev.size(0), 16)}
    encoder_out = model.encoder(src, src_lengths=lengths)
    for empty in (None, {**encoder_out, "encoder_out": []}):
        with pytest.raises(ValueError, match="^per-layer inputs of the decoder need an encoder output$"):
            model.decoder.extract_features(prev, empty, layer_extras=extras)


def test_encoder_takes_precomputed_token_embeddings_as_fairseqs():
    """``token_embeddings`` given to the encoder replace the looked-up embeddings, as in
    fairseq's encoder (here with a filled memory slot)."""
    dictionary = toy_dictionary()
    torch.manual_seed(0)
    reference = build_model("transformer", dictionary=dictionary).eval()
    ours = build_model("slot_transformer", "--decoder-cross-attention", "multi-layer", dictionary=dictionary).eval()
    ours.encoder.load_state_dict(reference.encoder.state_dict(), strict=False)
    src, lengths, _ = random_batch(dictionary)
    embeddings = torch.randn(src.size(0), src.size(1), 16, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = reference.encoder(src, src_lengths=lengths, token_embeddings=embeddings)["encoder_out"][0]
        got = ours.encoder(src, src_lengths=lengths, token_embeddings=embeddings)["encoder_out"][0]
        looked_up = ours.encoder(src, src_lengths=lengths)["encoder_out"][0]
    assert torch.equal(got, expected) and not torch.allclose(got, looked_up, atol=1e-3)


@pytest.mark.parametrize("norm", NORMALIZATION)
def test_cross_self_attention_model_equals_fairseq_transformer(norm):
    """``--cross-self-attention`` with the standard cross-attention: fairseq's transformer."""
    dictionary, reference, ours = fairseq_and_slot_model("--cross-self-attention", *NORMALIZATION[norm])
    src, lengths, prev = random_batch(dictionary)
    with torch.no_grad():
        assert torch.equal(ours(src, lengths, prev)[0], reference(src, lengths, prev)[0])


def test_cross_self_attention_with_another_cross_attention_is_refused():
    with pytest.raises(ValueError, match="^--cross-self-attention needs the standard decoder cross-attention$"):
        build_model("slot_transformer", "--decoder-cross-attention", "multi-layer", "--cross-self-attention")


def test_decoder_layers_attending_to_different_encoder_outputs_are_refused():
    """The decoder hands one encoder-output entry to all its layers: layers whose
    cross-attentions name different entries cannot be served."""
    model = build_model("slot_transformer", "--decoder-cross-attention", "multi-layer")
    assert model.decoder._memory_key() == "mlmha_taps"
    model.decoder.layers[0].encoder_attn.memory_key = "other"
    with pytest.raises(ValueError, match=r"^decoder layers attend to different encoder outputs: \['mlmha_taps', 'other'\]$"):
        model.decoder._memory_key()


def test_encoder_and_decoder_take_fairseqs_constructor_arguments_and_defaults():
    """Code that builds the slot model's stacks itself (as fairseq's ``build_encoder`` /
    ``build_decoder`` are public) gets fairseq's defaults: a decoder with cross-attention, and
    the dictionaries and output projection it passes."""
    dictionary, reference, ours = fairseq_and_slot_model()
    assert ours.encoder.dictionary is reference.encoder.dictionary is dictionary
    decoder_class = type(ours.decoder)
    default = decoder_class(ours.cfg, dictionary, ours.decoder.embed_tokens)
    assert all(layer.encoder_attn is not None for layer in default.layers)
    assert default.build_decoder_layer(ours.cfg).encoder_attn is not None
    projection = torch.nn.Linear(ours.cfg.decoder.embed_dim, len(dictionary), bias=False)
    given = decoder_class(ours.cfg, dictionary, ours.decoder.embed_tokens, output_projection=projection)
    assert given.output_projection is projection


@pytest.mark.parametrize("flags", [[], ["--min-params-to-wrap", "0"], ["--checkpoint-activations"]],
                         ids=["default", "wrap-all", "checkpoint"])
def test_layers_are_offered_to_fsdp_with_fairseqs_thresholds(flags, monkeypatch):
    """With fairscale present (``--ddp-backend fully_sharded``), fairseq's ``fsdp_wrap``
    hands a layer to ``fairscale.nn.wrap`` only above ``--min-params-to-wrap`` (always when
    checkpointing activations). fairscale is not a dependency, so a stand-in records the
    layers it is offered: the slot model must offer the ones fairseq's transformer does."""
    offered = []
    fairscale_nn = types.ModuleType("fairscale.nn")
    fairscale_nn.wrap = lambda module, **kwargs: offered.append(module) or module
    monkeypatch.setitem(sys.modules, "fairscale", types.ModuleType("fairscale"))
    monkeypatch.setitem(sys.modules, "fairscale.nn", fairscale_nn)
    counts = []
    for arch in ("transformer", "slot_transformer"):
        offered.clear()
        model = build_model(arch, *flags)
        counts.append(len(offered))
    assert counts[0] == counts[1]
    # every layer, or none: the tiny layers are under fairseq's default threshold (1e8)
    assert counts[0] == (0 if flags == [] else len(model.encoder.layers) + len(model.decoder.layers))


def test_encoder_returns_fairseqs_feed_forward_results_when_asked():
    """``return_fc`` (fairseq's encoder argument, used by models that read the FFN outputs):
    off by default for the stack and each layer, and when asked the encoder returns
    fairseq's ``fc_results``."""
    dictionary, reference, ours = fairseq_and_slot_model()
    cfg = ours.cfg
    assert not type(ours.encoder.layers[0])(cfg, 0).return_fc
    src, lengths, _ = random_batch(dictionary)
    results = []
    for model, encoder_class in ((reference, TransformerEncoderBase), (ours, type(ours.encoder))):
        encoder = encoder_class(cfg, dictionary, model.encoder.embed_tokens, return_fc=True).eval()
        encoder.load_state_dict(model.encoder.state_dict())
        results.append(encoder(src, lengths, return_all_hiddens=True)["fc_results"])
    assert len(results[0]) == len(results[1]) == cfg.encoder.layers
    assert all(r is not None for r in results[1])
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected)


def test_decoder_self_attention_builder_keeps_fairseqs_signature():
    """``build_self_attention`` is fairseq's public builder: its ``add_bias_kv`` and
    ``add_zero_attn`` (off by default) reach fairseq's attention when no mechanism claims the
    slot."""
    _, _, ours = fairseq_and_slot_model()
    layer, dim = ours.decoder.layers[0], ours.cfg.decoder.embed_dim
    default = layer.build_self_attention(dim, ours.cfg)
    assert default.bias_k is None and not default.add_zero_attn
    asked = layer.build_self_attention(dim, ours.cfg, add_bias_kv=True, add_zero_attn=True)
    assert asked.bias_k is not None and asked.add_zero_attn



MLMHA = ("--decoder-cross-attention", "multi-layer", "--mlmha-variant")


def test_a_state_dict_records_the_options_that_give_its_weights_their_meaning():
    """The package's options go into the state dict's metadata, as plain data (another value
    as its text), without adding a tensor; options read only at inference (ablations that
    ``--model-overrides`` sets) are not recorded."""
    model = build_model("slot_transformer", *MLMHA, "M-10")
    model.args.dc_encoder_layers = ("1", "2")  # not plain data
    state = model.state_dict()
    assert set(state) == set(build_model("slot_transformer", *MLMHA, "M-10").state_dict())
    recorded = recorded_options(state)
    assert recorded["decoder_cross_attention"] == "multi-layer" and recorded["mlmha_variant"] == "M-10"
    assert recorded["mlmha_bias"] is False and recorded["dc_encoder_layers"] == "('1', '2')"
    assert {"mlmha_mask_encoder_layer", "mlmha_mask_mode"}.isdisjoint(recorded)
    assert recorded_options(collections.OrderedDict(state)) is None  # a copy keeps no metadata
    bare = collections.OrderedDict()
    bare._metadata = collections.OrderedDict()  # metadata without the model's own entry
    assert recorded_options(bare) is None


def test_loading_weights_trained_with_other_options_warns_once_naming_them(caplog):
    """An M-10 state dict loads into an M-00 model (same shapes, another meaning): one warning
    names the option, its value and the checkpoint's; none for the same options or for a
    state dict that recorded none."""
    m10, m00 = build_model("slot_transformer", *MLMHA, "M-10"), build_model("slot_transformer", *MLMHA, "M-00")

    def warnings_loading(model, state):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            model.load_state_dict(state)
        return [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]

    warned = warnings_loading(m00, m10.state_dict())
    assert len(warned) == 1
    assert warned[0].startswith("the checkpoint was trained with other options of this package: "
                                "--mlmha-variant M-00 (checkpoint: M-10); ")
    assert warnings_loading(m10, m10.state_dict()) == []
    assert warnings_loading(m00, collections.OrderedDict(m10.state_dict())) == []


def dlcl_encoders_selecting_the_layer_below(return_fc=False):
    """fairseq's encoder and the DLCL slot encoder (post-norm) with fairseq's weights, each
    DLCL row putting all its weight on the layer just below: then every layer reads the
    LayerNorm of the previous layer's output, itself a LayerNorm's output (so the same up
    to LayerNorm's eps), and the DLCL encoder computes fairseq's plain stack."""
    dictionary = toy_dictionary()
    torch.manual_seed(0)
    reference = build_model("transformer", dictionary=dictionary).eval()
    ours = build_model("slot_transformer", "--dlcl-encoder", dictionary=dictionary).eval()
    encoders = []
    for model, encoder_class in ((reference, TransformerEncoderBase), (ours, type(ours.encoder))):
        encoder = encoder_class(model.cfg, dictionary, model.encoder.embed_tokens, return_fc=return_fc).eval()
        encoder.load_state_dict(reference.encoder.state_dict(), strict=False)
        encoders.append(encoder)
    assert encoders[1].layer_inputs is not None
    with torch.no_grad():
        for row in encoders[1].layer_inputs.weights:
            row.zero_()
            row[-1] = 1.0
    return dictionary, encoders[0], encoders[1]


@pytest.mark.parametrize("left_pad", [True, False, None], ids=["left-pad", "right-pad", "no-pad"])
@pytest.mark.parametrize("given_embeddings", [False, True], ids=["looked-up", "token-embeddings"])
def test_dlcl_encoder_returns_fairseqs_outputs_when_it_combines_only_the_layer_below(left_pad, given_embeddings):
    """The DLCL encoder writes fairseq's layer loop out again: with weights that select the
    layer below it returns what fairseq's encoder returns for the same batch (padded or not,
    with precomputed ``token_embeddings`` or not): the output, every layer's state and
    feed-forward result when asked, the padding mask, the embedding and ``src_lengths``
    (int32, B x 1), including the padded positions."""
    dictionary, reference, ours = dlcl_encoders_selecting_the_layer_below(return_fc=True)
    src, lengths, _ = random_batch(dictionary, left_pad=bool(left_pad), batch_size=3)
    if left_pad is None:
        src = src[:, -4:].clone()
        src[src.eq(dictionary.pad())] = dictionary.nspecial
        lengths = torch.full_like(lengths, 4)
        assert not src.eq(dictionary.pad()).any()
    extra = {}
    if given_embeddings:
        extra["token_embeddings"] = torch.randn(src.size(0), src.size(1), 16,
                                                generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = reference(src, lengths, return_all_hiddens=True, **extra)
        got = ours(src, lengths, return_all_hiddens=True, **extra)
    close = dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got["encoder_out"][0], expected["encoder_out"][0], **close)
    assert torch.equal(got["encoder_padding_mask"][0], expected["encoder_padding_mask"][0])
    assert torch.equal(got["encoder_embedding"][0], expected["encoder_embedding"][0])
    assert len(got["encoder_states"]) == len(expected["encoder_states"]) == len(ours.layers) + 1
    for state, expected_state in zip(got["encoder_states"], expected["encoder_states"]):
        torch.testing.assert_close(state, expected_state, **close)
    assert len(got["fc_results"]) == len(expected["fc_results"]) == len(ours.layers)
    for result, expected_result in zip(got["fc_results"], expected["fc_results"]):
        torch.testing.assert_close(result, expected_result, **close)
    got_lengths, expected_lengths = got["src_lengths"][0], expected["src_lengths"][0]
    assert got_lengths.dtype == expected_lengths.dtype and torch.equal(got_lengths, expected_lengths)


def test_dlcl_encoder_returns_layer_states_only_when_asked():
    """As fairseq's ``forward_scriptable``, the DLCL encoder's returns no layer states or
    feed-forward results unless ``return_all_hiddens`` is given."""
    dictionary, reference, ours = dlcl_encoders_selecting_the_layer_below()
    src, lengths, _ = random_batch(dictionary)
    with torch.no_grad():
        expected = reference.forward_scriptable(src, lengths)
        got = ours.forward_scriptable(src, lengths)
    assert got["encoder_states"] == expected["encoder_states"] == []
    assert got["fc_results"] == expected["fc_results"] == []
    torch.testing.assert_close(got["encoder_out"][0], expected["encoder_out"][0], atol=1e-4, rtol=1e-4)


def test_a_hydra_model_config_builds_the_model_it_describes_and_is_checked():
    """``build_model`` takes fairseq-hydra-train's ``DictConfig``: the model is built with the
    config's options (sizes, a mechanism switched on), a mechanism option set while its
    mechanism is off is refused as it is on the command line, and an option the model does
    not have is refused naming it."""
    dictionary = toy_dictionary()
    args = options.parse_args_and_arch(options.get_training_parser(), [
        "unused-data-dir", "--task", "translation", "--user-dir", USER_DIR,
        "--arch", "slot_transformer", *TINY_MODEL_ARGS])
    task = tasks.translation.TranslationTask(args, dictionary, dictionary)
    sizes = {"encoder_embed_dim": 16, "decoder_embed_dim": 16, "encoder_ffn_embed_dim": 32,
             "decoder_ffn_embed_dim": 32, "encoder_attention_heads": 2, "decoder_attention_heads": 2}
    cfg = OmegaConf.create({"_name": "slot_transformer", "encoder_layers": 2, "decoder_layers": 1,
                            "dlcl_encoder": True, **sizes})
    model = SlotTransformerModel.build_model(cfg, task)
    assert isinstance(model, SlotTransformerModel)
    assert len(model.encoder.layers) == 2 and len(model.decoder.layers) == 1
    assert model.encoder.layer_inputs is not None and model.encoder.embed_tokens.embedding_dim == 16
    off = OmegaConf.create({"_name": "slot_transformer", "mlmha_variant": "M-10", **sizes})
    with pytest.raises(UsageError, match=r"^--mlmha-variant M-10 needs --decoder-cross-attention multi-layer"):
        SlotTransformerModel.build_model(off, task)
    unknown = OmegaConf.create({"_name": "slot_transformer", "mlmha_varaint": "M-10"})
    with pytest.raises(UsageError, match=r"^model.mlmha_varaint: not an option of SlotTransformerModel"):
        SlotTransformerModel.build_model(unknown, task)


def test_layer_and_encoder_slot_fillers_are_given_the_config_and_where_they_build(stage_slots, monkeypatch):
    """A filler of the encoder layer's after-self-attention and feed-forward slots, the
    decoder layer's feed-forward slot and the encoder's layer-inputs slot is called with the model's config
    and where it builds: the layer index and width (and the decoder's layer context), or the
    number of encoder layers."""
    from mlmha_fairseq.models.slot_transformer import SlotTransformerDecoderLayer, SlotTransformerEncoderLayer

    monkeypatch.setattr(slots.ENCODER_LAYER_INPUTS, "_fillers", dict(slots.ENCODER_LAYER_INPUTS._fillers))
    seen = {}

    def recorder(name):
        def filler(cfg, **where):
            seen[name] = (cfg, where)  # claims nothing: the layer stays fairseq's
        return filler

    slots.ENCODER_AFTER_SELF_ATTENTION.register("test")(recorder("encoder after self-attention"))
    slots.ENCODER_FEED_FORWARD.register("test")(recorder("encoder feed-forward"))
    slots.DECODER_FEED_FORWARD.register("test")(recorder("decoder feed-forward"))
    slots.ENCODER_LAYER_INPUTS.register("test")(recorder("encoder layer inputs"))
    cfg = layer_config("post-norm")
    SlotTransformerEncoderLayer(cfg, layer_idx=2)
    assert seen["encoder after self-attention"] == (cfg, {"layer_idx": 2, "embed_dim": 16})
    assert seen["encoder feed-forward"] == (cfg, {"layer_idx": 2, "embed_dim": 16})
    SlotTransformerDecoderLayer(cfg, layer_idx=1, test_context="a")
    assert seen["decoder feed-forward"] == (cfg, {"layer_idx": 1, "embed_dim": 16, "test_context": "a"})
    model = build_model("slot_transformer")
    layer_inputs_cfg, where = seen["encoder layer inputs"]
    assert where == {"num_layers": 3} and layer_inputs_cfg.encoder.layers == 3
    assert model.encoder.layer_inputs is None


def test_dlcl_with_a_mechanism_that_replaces_the_encoder_output_is_refused():
    """DLCL's last row is the encoder output: a memory mechanism that replaces it too is
    refused, naming both."""
    with pytest.raises(ValueError, match=r"^the encoder output 'encoder_out' is written by several mechanisms "
                                         r"\(--layer-aggregation s-agg, --dlcl-encoder\): choose one$"):
        build_model("slot_transformer", "--dlcl-encoder", "--layer-aggregation", "s-agg")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
def test_encoder_layer_attention_mask_outweighs_large_attention_scores_as_fairseqs(dtype):
    """A masked position gets fairseq's additive mask (-1e8 in float32, -1e4 in half
    precision, where -1e8 does not fit): with attention scores of the order of 1e5 a milder
    mask would let masked positions through in float32, and the layer's output is fairseq's
    in both precisions."""
    from fairseq.modules.transformer_layer import TransformerEncoderLayerBase

    from mlmha_fairseq.models.slot_transformer import SlotTransformerEncoderLayer

    cfg = layer_config("post-norm")
    torch.manual_seed(0)
    reference = TransformerEncoderLayerBase(cfg)
    if dtype == torch.float32:
        with torch.no_grad():  # scores q.k of the order of 1e5
            reference.self_attn.q_proj.weight.mul_(300.0)
            reference.self_attn.k_proj.weight.mul_(300.0)
    ours = SlotTransformerEncoderLayer(cfg, layer_idx=0)
    ours.load_state_dict(reference.state_dict(), strict=True)
    reference, ours = reference.eval().to(dtype), ours.eval().to(dtype)
    x, _, _ = layer_inputs()
    x = x.to(dtype)
    padding = torch.zeros(x.size(1), x.size(0), dtype=torch.bool)
    mask = torch.triu(torch.ones(x.size(0), x.size(0)), 1).to(dtype)
    with torch.no_grad():
        expected = reference(x, padding, attn_mask=mask)
        got = ours(x, padding, attn_mask=mask)
        causal_ours = ours(x[:2], padding[:, :2], attn_mask=mask[:2, :2])
    assert torch.equal(got, expected)
    if dtype == torch.float32:  # the first positions do not see the later ones
        torch.testing.assert_close(got[:2], causal_ours)


def test_a_stage_module_may_not_take_an_attribute_the_layer_already_has():
    """A filler's module is kept under the attribute it declares (its parameter names in
    checkpoints): one that would replace a submodule of fairseq's layer is refused."""
    from mlmha_fairseq.models.slot_transformer import SlotTransformerEncoderLayer, keep_stage_module

    layer = SlotTransformerEncoderLayer(layer_config("post-norm"), layer_idx=0)
    clash = Shift()
    clash.layer_attribute = "fc1"
    with pytest.raises(ValueError, match="^the layer already has a 'fc1'$"):
        keep_stage_module(layer, clash)
    assert keep_stage_module(layer, Shift()) == "shift" and isinstance(layer.shift, Shift)
    assert keep_stage_module(layer, None) is None


def test_the_staged_layers_are_importable_from_the_slot_transformer_module_as_before():
    """They have their own module now; the module path they had is public interface."""
    from mlmha_fairseq.models import slot_transformer, staged_layers

    for name in ("SlotTransformerEncoderLayer", "SlotTransformerDecoderLayer", "LayerInput", "keep_stage_module"):
        assert getattr(slot_transformer, name) is getattr(staged_layers, name)
