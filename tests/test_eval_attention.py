import json
import math

import numpy as np
import pytest
import torch

from fixtures.tiny_fairseq import build_task_and_model, encode, save_checkpoint, write_data_bin
from mlmha_fairseq.evaluation.attention_statistics import (
    AttentionStatistics,
    distance_sums,
    encoder_attention_statistics,
    entropy_sums,
    recording_self_attention,
)
from mlmha_fairseq.evaluation.model_loading import batches

# one head, three tokens; rows are query positions i, columns key positions j
W = torch.tensor([[[0.5, 0.5, 0.0],
                   [0.2, 0.6, 0.2],
                   [0.1, 0.1, 0.8]]])


def h(p):
    return -p * math.log(p)


def test_literal_distance_by_hand():
    numerator, denominator = distance_sums(W)
    # j <= i only, weight * (i - j)
    assert numerator[0] == pytest.approx(0.2 * 1 + 0.1 * 2 + 0.1 * 1)
    assert denominator[0] == pytest.approx(0.5 + (0.2 + 0.6) + (0.1 + 0.1 + 0.8))


def test_full_row_distance_by_hand():
    numerator, denominator = distance_sums(W, full_row=True)
    assert numerator[0] == pytest.approx(0.5 * 1 + 0.2 * 1 + 0.2 * 1 + 0.1 * 2 + 0.1 * 1)
    assert denominator[0] == pytest.approx(3.0)


def test_entropy_by_hand():
    literal = h(0.5) + (h(0.2) + h(0.6)) + (h(0.1) + h(0.1) + h(0.8))
    full = (h(0.5) + h(0.5)) + (h(0.2) + h(0.6) + h(0.2)) + (h(0.1) + h(0.1) + h(0.8))
    assert entropy_sums(W)[0] == pytest.approx(literal)
    assert entropy_sums(W, full_row=True)[0] == pytest.approx(full)


def test_corpus_aggregation_is_ratio_of_sums():
    second = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    two_heads = torch.cat([W, W.flip(-1) / 1.0])
    stats = AttentionStatistics(layers=1, heads=1)
    stats.update(0, W)
    stats.update(0, second)
    expected_distance = (0.2 + 0.2 + 0.1) / (0.5 + 0.8 + 1.0 + 1.0 + 1.0)
    assert stats.head_distance()[0, 0] == pytest.approx(expected_distance)
    expected_entropy = (h(0.5) + h(0.2) + h(0.6) + 2 * h(0.1) + h(0.8) + 0.0) / 5
    assert stats.head_entropy()[0, 0] == pytest.approx(expected_entropy)

    per_head = AttentionStatistics(layers=1, heads=2)
    per_head.update(0, two_heads)
    flipped_num, flipped_den = distance_sums(W.flip(-1))
    assert per_head.head_distance()[0, 1] == pytest.approx(flipped_num[0] / flipped_den[0])
    assert per_head.layer_distance()[0] == pytest.approx(per_head.head_distance()[0].mean())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    data = write_data_bin(str(tmp_path_factory.mktemp("data-bin")))
    cfg, task, model = build_task_and_model(data, seed=5)
    return data, cfg, task, model


SENTENCES = ["w1 w2 w3", "w4 w5 w6 w7 w8 w9", "w10", "w2 w2 w3 w11"]


def test_captured_weights_are_per_head_probabilities(tiny):
    _, _, task, model = tiny
    dictionary = task.source_dictionary
    src_tokens, src_lengths = next(batches(encode(dictionary, SENTENCES), dictionary, 8))
    with recording_self_attention(model) as records, torch.no_grad():
        model.encoder(src_tokens, src_lengths=src_lengths)
    heads = model.encoder.layers[0].self_attn.num_heads
    pad = src_tokens.eq(dictionary.pad())
    for weights in records:
        assert weights.shape == (heads, len(SENTENCES), src_tokens.size(1), src_tokens.size(1))
        real_queries = weights.permute(1, 2, 0, 3)[~pad]
        torch.testing.assert_close(real_queries.sum(-1), torch.ones_like(real_queries.sum(-1)))
        assert torch.all(weights.permute(1, 0, 2, 3).masked_select(pad[:, None, None, :]) == 0)
        assert not torch.allclose(weights[0], weights[1])


def test_padding_is_excluded(tiny):
    _, _, task, model = tiny
    dictionary = task.source_dictionary
    tokens = encode(dictionary, SENTENCES)
    padded = encoder_attention_statistics(model, batches(tokens, dictionary, 4), dictionary.pad(),
                                          dictionary.eos())
    alone = encoder_attention_statistics(model, batches(tokens, dictionary, 1), dictionary.pad(),
                                         dictionary.eos())
    assert padded.tokens[0] == sum(t.numel() for t in tokens)
    np.testing.assert_allclose(padded.head_distance(), alone.head_distance(), rtol=1e-5)
    np.testing.assert_allclose(padded.head_entropy(), alone.head_entropy(), rtol=1e-5)
    without_eos = encoder_attention_statistics(model, batches(tokens, dictionary, 4),
                                               dictionary.pad(), dictionary.eos(), exclude_eos=True)
    assert without_eos.tokens[0] == sum(t.numel() - 1 for t in tokens)


def test_attention_stats_cli(tiny, tmp_path, capsys):
    pytest.importorskip("mlmha_fairseq.compat")
    from mlmha_fairseq.cli import attention_stats

    data, cfg, _, model = tiny
    checkpoint = save_checkpoint(str(tmp_path / "model.pt"), cfg, model)
    source = tmp_path / "src.txt"
    source.write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    prefix = str(tmp_path / "attn")
    attention_stats.main([checkpoint, checkpoint, "--names", "a", "b", "--data-bin", data,
                          "--input", str(source), "--sample", "3", "--output-prefix", prefix])
    payload = json.loads((tmp_path / "attn.json").read_text())
    assert payload["sentences"] == 3
    assert payload["layers"]["a"] == payload["layers"]["b"]
    assert (tmp_path / "attn_heads.png").exists() and (tmp_path / "attn_layers.png").exists()
