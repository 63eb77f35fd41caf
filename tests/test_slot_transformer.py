"""The slot model with every slot at its default is fairseq's transformer."""
import pytest
import torch

from fairseq_helpers import assert_incremental_matches_full, build_model, random_batch, toy_dictionary
from mlmha_fairseq.models import slots
from mlmha_fairseq.models.slot_transformer import SlotTransformerModel

NORMALIZATION = {
    "post-norm": [],
    "pre-norm": ["--encoder-normalize-before", "--decoder-normalize-before"],
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
    slot = slots.Slot("test")
    slot.register("a")(lambda cfg, **ctx: torch.nn.Identity())
    slot.register("b")(lambda cfg, **ctx: torch.nn.Identity())
    with pytest.raises(ValueError, match=r"claimed by several mechanisms \(a, b\)"):
        slot.build(object(), layer_idx=0)


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
