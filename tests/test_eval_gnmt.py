import pytest
import torch
from fairseq.dataclass.configs import GenerationConfig
from fairseq.sequence_generator import SequenceGenerator

from fixtures.tiny_fairseq import build_task_and_model, encode, write_data_bin
from mlmha_fairseq.generation.gnmt_length_penalty import (
    GNMTSequenceGenerator,
    gnmt_length_penalty,
    rerank_gnmt,
)
from mlmha_fairseq.tasks.translation_gnmt import TranslationGNMTTask

SOURCES = ["w1 w2 w3", "w4 w5", "w6 w7 w8 w9 w10 w11", "w3"]
BEAM = 5


def hypo(length, score):
    return {"tokens": torch.arange(length), "score": torch.tensor(score)}


def test_penalty_formula():
    assert gnmt_length_penalty(1, 0.6) == pytest.approx(1.0)
    assert gnmt_length_penalty(7, 1.0) == pytest.approx(12 / 6)
    assert gnmt_length_penalty(10, 0.6) == pytest.approx((15 / 6) ** 0.6)
    assert gnmt_length_penalty(42, 0.0) == 1.0


def test_rerank_toy_nbest_follows_formula():
    # raw log-probs favour the short hypothesis; GNMT with alpha=1 favours the long one:
    # -2.0 / ((5+3)/6) = -1.5  <  -3.0 / ((5+9)/6) = -1.2857
    short, long = hypo(3, -2.0), hypo(9, -3.0)
    assert [len(h["tokens"]) for h in rerank_gnmt([short, long], 0.0)] == [3, 9]
    reranked = rerank_gnmt([short, long], 1.0)
    assert [len(h["tokens"]) for h in reranked] == [9, 3]
    assert float(reranked[0]["score"]) == pytest.approx(-3.0 / (14 / 6))
    assert float(reranked[1]["score"]) == pytest.approx(-2.0 / (8 / 6))
    # fairseq's --lenpen 1 (score / |Y|) would rank these the same way, but not these two:
    a, b = hypo(2, -1.0), hypo(12, -4.0)
    assert -1.0 / 2 < -4.0 / 12
    assert [len(h["tokens"]) for h in rerank_gnmt([a, b], 1.0)] == [2, 12]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    data = write_data_bin(str(tmp_path_factory.mktemp("data-bin")))
    cfg, task, model = build_task_and_model(data, seed=3)
    tokens = encode(task.source_dictionary, SOURCES)
    from fairseq.data.data_utils import collate_tokens

    src = collate_tokens(tokens, task.source_dictionary.pad(), left_pad=True)
    sample = {"net_input": {"src_tokens": src, "src_lengths": torch.tensor([t.numel() for t in tokens])}}
    return data, task, model, sample


def generate(generator_cls, model, task, sample, **kwargs):
    generator = generator_cls([model], task.target_dictionary, beam_size=BEAM, max_len_a=1,
                              max_len_b=4, **kwargs)
    return generator.generate([model], sample)


def assert_same(first, second):
    for hypos_a, hypos_b in zip(first, second):
        assert len(hypos_a) == len(hypos_b)
        for a, b in zip(hypos_a, hypos_b):
            assert torch.equal(a["tokens"], b["tokens"])
            assert float(a["score"]) == pytest.approx(float(b["score"]), abs=1e-6)


@pytest.fixture(scope="module")
def fairseq_lenpen_zero(tiny):
    _, task, model, sample = tiny
    return generate(SequenceGenerator, model, task, sample, len_penalty=0.0)


def test_alpha_zero_equals_fairseq_lenpen_zero(tiny, fairseq_lenpen_zero):
    _, task, model, sample = tiny
    gnmt_out = generate(GNMTSequenceGenerator, model, task, sample, gnmt_alpha=0.0)
    assert_same(fairseq_lenpen_zero, gnmt_out)


def test_alpha_reranks_fairseq_finalised_set(tiny, fairseq_lenpen_zero):
    _, task, model, sample = tiny
    alpha = 1.5
    gnmt_out = generate(GNMTSequenceGenerator, model, task, sample, gnmt_alpha=alpha, len_penalty=1.0)
    assert_same([rerank_gnmt(h, alpha) for h in fairseq_lenpen_zero], gnmt_out)
    orders = [[h["tokens"].tolist() for h in hypos] for hypos in fairseq_lenpen_zero]
    reordered = [[h["tokens"].tolist() for h in hypos] for hypos in gnmt_out]
    assert orders != reordered, "the toy decoding should change order with alpha"


def test_task_builds_gnmt_generator_only_when_asked(tiny):
    data, _, _, _ = tiny
    generation = GenerationConfig(beam=BEAM, lenpen=2.0)
    _, task, model = build_task_and_model(data, task="translation_gnmt",
                                          extra_args=["--gnmt-lenpen", "0.6"])
    assert isinstance(task, TranslationGNMTTask)
    generator = task.build_generator([model], generation)
    assert isinstance(generator, GNMTSequenceGenerator)
    assert generator.gnmt_alpha == 0.6 and generator.len_penalty == 0.0

    _, task, model = build_task_and_model(data, task="translation_gnmt")
    generator = task.build_generator([model], generation)
    assert type(generator) is SequenceGenerator and generator.len_penalty == 2.0

