"""MLMHA in beam search keeps one cache row per sentence (the beams share it): the outputs
equal those of a cache per hypothesis, through beam reordering and finished sentences."""
import pytest
import torch
from fairseq.sequence_generator import SequenceGenerator

from fairseq_helpers import build_model, random_batch, toy_dictionary

from mlmha_fairseq.modules.multi_layer_attention import MultiLayerMultiheadAttention, parse_variant

BEAM, SENTENCES, DIM = 3, 2, 16


def module_pair(variant):
    torch.manual_seed(0)
    per_sentence = MultiLayerMultiheadAttention(DIM, 4, 3, *parse_variant(variant), bias=True).eval()
    per_hypothesis = MultiLayerMultiheadAttention(DIM, 4, 3, *parse_variant(variant), bias=True).eval()
    per_hypothesis.load_state_dict(per_sentence.state_dict())
    per_sentence.set_beam_size(BEAM)
    return per_sentence, per_hypothesis


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("variant", ["M-00", "M-01", "M-10", "M-11"])
def test_per_sentence_cache_equals_per_hypothesis_cache(variant, need_weights):
    per_sentence, per_hypothesis = module_pair(variant)
    gen = torch.Generator().manual_seed(1)
    # taps and mask of 2 sentences, each repeated for its 3 beams (rows 0-2, 3-5)
    taps = torch.randn(3, 5, SENTENCES, DIM, generator=gen).repeat_interleave(BEAM, dim=2)
    mask = (torch.arange(5)[None, :] >= torch.tensor([5, 3])[:, None]).repeat_interleave(BEAM, dim=0)
    # beams moved within their sentences, then sentence 0 finished (rows 3-5 survive)
    orders = {1: torch.tensor([1, 1, 0, 5, 3, 4]), 2: torch.tensor([4, 3, 3])}
    states = {}, {}
    for step in range(4):
        if step in orders:
            for module, state in zip((per_sentence, per_hypothesis), states):
                module.reorder_incremental_state(state, orders[step])
            taps, mask = taps[:, :, orders[step]], mask[orders[step]]
        query = torch.randn(1, taps.size(2), DIM, generator=gen)
        outputs = [module(query, taps, taps, key_padding_mask=mask, incremental_state=state, need_weights=need_weights)
                   for module, state in zip((per_sentence, per_hypothesis), states)]
        torch.testing.assert_close(outputs[0][0], outputs[1][0], atol=1e-6, rtol=0)
        if need_weights:
            torch.testing.assert_close(outputs[0][1], outputs[1][1], atol=1e-6, rtol=0)
    # one cached row per surviving sentence, against one per hypothesis
    assert per_sentence._get_input_buffer(states[0])["key"].size(0) == 1
    assert per_hypothesis._get_input_buffer(states[1])["key"].size(0) == BEAM


def test_beam_search_finds_the_same_hypotheses_with_either_cache():
    dictionary = toy_dictionary()
    model = build_model("slot_transformer", "--decoder-cross-attention", "multi-layer", dictionary=dictionary).eval()
    src, lengths, _ = random_batch(dictionary, batch_size=4)
    sample = {"net_input": {"src_tokens": src, "src_lengths": lengths}}
    results = []
    for beam_size_seen_by_mlmha in (BEAM, 1):
        generator = SequenceGenerator([model], dictionary, beam_size=BEAM, max_len_b=8)  # gives the model the beam
        model.set_beam_size(beam_size_seen_by_mlmha)
        with torch.no_grad():
            results.append(generator.generate([model], sample))
    mlmha = [m for m in model.modules() if isinstance(m, MultiLayerMultiheadAttention)]
    assert mlmha and all(m.beam_size == 1 for m in mlmha)
    for folded, reference in zip(*results):
        assert [h["tokens"].tolist() for h in folded] == [h["tokens"].tolist() for h in reference]
        torch.testing.assert_close(torch.stack([h["score"] for h in folded]),
                                   torch.stack([h["score"] for h in reference]), atol=1e-5, rtol=0)
