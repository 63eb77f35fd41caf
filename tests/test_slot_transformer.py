"""The slot model with every slot at its default is fairseq's transformer."""
import pytest
import torch

from fairseq_helpers import PRE_NORM, assert_incremental_matches_full, build_model, random_batch, toy_dictionary
from mlmha_fairseq.models import slots
from mlmha_fairseq.models.slot_transformer import SlotTransformerModel

NORMALIZATION = {
    "post-norm": [],
    "pre-norm": PRE_NORM,
}


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

def layer_pair(norm, layer_class=None, **settings):
    """fairseq's decoder layer and the staged slot layer (or ``layer_class``) with the same
    weights."""
    from fairseq import options
    from fairseq.models.transformer import TransformerConfig
    from fairseq.modules.transformer_layer import TransformerDecoderLayerBase

    from fairseq_helpers import TINY_MODEL_ARGS, USER_DIR
    from mlmha_fairseq.models.slot_transformer import SlotTransformerDecoderLayer

    args = options.parse_args_and_arch(options.get_training_parser(), [
        "unused-data-dir", "--task", "translation", "--user-dir", USER_DIR, "--arch", "slot_transformer",
        *TINY_MODEL_ARGS, *NORMALIZATION[norm]])
    vars(args).update(settings)  # fairseq's --scale-* settings have no legacy command-line option
    cfg = TransformerConfig.from_namespace(args)
    torch.manual_seed(0)
    reference = TransformerDecoderLayerBase(cfg)
    ours = (layer_class or SlotTransformerDecoderLayer)(cfg, layer_idx=0)
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


def test_staged_layer_passes_per_call_extras_to_the_step_after_self_attention():
    from mlmha_fairseq.models.slot_transformer import LayerInput, SlotTransformerDecoderLayer

    class Shifted(SlotTransformerDecoderLayer):
        def after_self_attention(self, x, extras):
            return x + extras["shift"]

    reference, shifted = layer_pair("post-norm", Shifted)
    x, memory, padding = layer_inputs()
    shift = torch.full_like(x, 0.5)
    with torch.no_grad():
        got = shifted(x, LayerInput(memory, {"shift": shift}), padding)[0]
        # the same layer from its stages, the shift added between them by hand
        h = shifted.self_attention_stage(x, memory, padding, None, None, None, None)
        h, _ = shifted.cross_attention_stage(h + shift, memory, padding, None, None, False, False)
        expected = shifted.feed_forward_stage(h)
        plain = reference(x, memory, padding)[0]
    assert torch.equal(got, expected)
    assert not torch.allclose(got, plain, atol=1e-3)


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
