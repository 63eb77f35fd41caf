"""Encoder-based multi-level supervision: auxiliary decoders, the joint loss, AIF (thesis ch. 4)."""
import json
import logging
import math
import re

import pytest
import torch
from fairseq import checkpoint_utils
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    label_smoothed_nll_loss,
)
from fairseq.logging import metrics
from fairseq.sequence_generator import SequenceGenerator

from fairseq_helpers import (
    ALIGNMENT_OPTIONS,
    NORMS,
    assert_features_match_with_alignment_options,
    assert_beam_search_scores_match_full,
    assert_incremental_matches_full,
    build_model,
    random_batch,
    run_fairseq,
    toy_dictionary,
    train_args,
)
from test_distributed import assert_ranks_identical_after_training

from mlmha_fairseq.cli import aif_dependency as aif_dependency_cli
from mlmha_fairseq.cli import strip_aux_decoders
from mlmha_fairseq.criterions.multi_decoder_label_smoothed_cross_entropy import (
    MultiDecoderLabelSmoothedCrossEntropyCriterion,
)
from mlmha_fairseq.evaluation.aif_dependency import aif_dependency, kl_divergence
from mlmha_fairseq.evaluation.model_loading import batches

D, FFN, DECODER_LAYERS = 16, 32, 2  # tests/fairseq_helpers.TINY_MODEL_ARGS
EPSILON = 0.1
CRITERION = ["--criterion", "multi_decoder_label_smoothed_cross_entropy", "--label-smoothing", str(EPSILON)]


def ms(layers="1", *extra):
    return ["--aux-decoder-layers", layers, *extra]


def num_params(model):
    return sum(p.numel() for p in model.parameters())


def decoder_stack_params(pre_norm: bool) -> int:
    """One fairseq decoder stack without embeddings: per layer self- and cross-attention
    (4 d x d projections with biases each), FFN, 3 LayerNorms; pre-norm adds the final
    LayerNorm and the auxiliary memory's LayerNorm."""
    attention = 4 * (D * D + D)
    per_layer = 2 * attention + (D * FFN + FFN) + (FFN * D + D) + 3 * 2 * D
    return DECODER_LAYERS * per_layer + (2 * 2 * D if pre_norm else 0)


class Task:
    def __init__(self, dictionary):
        self.target_dictionary = dictionary


def toy_sample(dictionary, seed=0):
    src, lengths, prev = random_batch(dictionary, seed=seed)
    target = torch.cat([prev[:, 1:], torch.full((prev.size(0), 1), dictionary.eos())], dim=1)
    target[0, -2:] = dictionary.pad()  # some padding in the targets
    return {"net_input": {"src_tokens": src, "src_lengths": lengths, "prev_output_tokens": prev},
            "target": target, "ntokens": int(target.ne(dictionary.pad()).sum())}


def criterion(dictionary, gamma):
    return MultiDecoderLabelSmoothedCrossEntropyCriterion(Task(dictionary), False, EPSILON,
                                                          aux_loss_weight=gamma)


@NORMS
def test_without_auxiliary_decoders_the_model_is_the_slot_transformer(norm):
    dictionary = toy_dictionary()
    reference = build_model("slot_transformer", *norm, dictionary=dictionary).eval()
    model = build_model("ms_transformer", *ms("none"), *norm, dictionary=dictionary).eval()
    model.load_state_dict(reference.state_dict(), strict=True)
    src, lengths, prev = random_batch(dictionary)
    with torch.no_grad():
        torch.testing.assert_close(model(src, lengths, prev)[0], reference(src, lengths, prev)[0])


# --- the joint loss (Eq. 4.1) ---------------------------------------------------------------

@pytest.mark.parametrize("gamma", [1.0, 0.5])
def test_joint_loss_is_main_plus_gamma_times_auxiliary_losses(gamma):
    dictionary = toy_dictionary()
    model = build_model("ms_transformer", *ms("1,2"), dictionary=dictionary).eval()
    sample = toy_sample(dictionary)
    loss, sample_size, logs = criterion(dictionary, gamma)(model, sample)
    with torch.no_grad():
        logits, extra = model(**sample["net_input"])
        decoders = [logits] + [aux_logits for aux_logits, _ in extra["aux_out"]]
        losses = [label_smoothed_nll_loss(torch.log_softmax(x, -1).view(-1, x.size(-1)),
                                          sample["target"].view(-1), EPSILON,
                                          ignore_index=dictionary.pad())[0] for x in decoders]
    torch.testing.assert_close(loss.detach(), losses[0] + gamma * (losses[1] + losses[2]))
    assert sample_size == sample["ntokens"]
    torch.testing.assert_close(logs["loss"], losses[0])  # checkpoint selection: the main decoder
    torch.testing.assert_close(logs["aux1_loss"], losses[1])
    torch.testing.assert_close(logs["aux2_loss"], losses[2])
    torch.testing.assert_close(logs["joint_loss"], loss.detach())
    assert not torch.allclose(losses[0], losses[1])


def test_gamma_zero_equals_fairseq_label_smoothed_cross_entropy():
    dictionary = toy_dictionary()
    model = build_model("ms_transformer", *ms("1"), "--aux-fusion", dictionary=dictionary).eval()
    sample = toy_sample(dictionary)
    ours = criterion(dictionary, 0.0)(model, sample)
    fairseqs = LabelSmoothedCrossEntropyCriterion(Task(dictionary), False, EPSILON)(model, sample)
    torch.testing.assert_close(ours[0], fairseqs[0])
    assert ours[1] == fairseqs[1]
    for key in ("loss", "nll_loss", "ntokens", "nsentences", "sample_size"):
        assert ours[2][key] == fairseqs[2][key], key


def label_smoothed_ce(logits, target, epsilon, pad):
    """fairseq's token-level label-smoothed cross-entropy in plain torch, per target token
    (B*T), zero at padding: ``(1 - eps - eps_i) * nll + eps_i * sum_v -log p_v`` with
    ``eps_i = eps / (V - 1)``; and the token's nll."""
    lprobs = torch.log_softmax(logits, dim=-1).reshape(-1, logits.size(-1))
    target = target.reshape(-1)
    nll = -lprobs[torch.arange(target.numel()), target]
    smooth = -lprobs.sum(dim=-1)
    eps_i = epsilon / (logits.size(-1) - 1)
    keep = target.ne(pad)
    return ((1 - epsilon - eps_i) * nll + eps_i * smooth) * keep, nll * keep


def close(got, expected, msg=None):
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5, msg=msg)


def decoder_logits(model, sample):
    """The logits of the Main-Decoder and of each auxiliary decoder (teacher forcing).
    The models of these tests are float64; fairseq's criterion takes the log-softmax in
    float32 (``get_normalized_probs``), hence ``close`` below: float32 against float64."""
    with torch.no_grad():
        logits, extra = model(**sample["net_input"])
    return [logits] + [aux_logits for aux_logits, _ in extra["aux_out"]]


@pytest.mark.parametrize("sentence_avg", [False, True], ids=["per-token", "sentence-avg"])
@pytest.mark.parametrize("prefix", [0, 1], ids=["whole-target", "ignore-prefix-1"])
def test_unreduced_joint_loss_is_the_per_token_equation(sentence_avg, prefix):
    """Eq. 4.1 per target token (``reduce=False``): J_t = L_m,t + gamma * (L_a1,t + L_a2,t),
    each the label-smoothed CE of plain torch on the target without its first ``prefix``
    tokens (``--ignore-prefix-size``); the sample size is fairseq's: target tokens, or
    sentences with ``--sentence-avg``. float64."""
    dictionary, gamma = toy_dictionary(), 0.5
    model = build_model("ms_transformer", *ms("1,2"), dictionary=dictionary).double().eval()
    sample = toy_sample(dictionary)
    criterion_ = MultiDecoderLabelSmoothedCrossEntropyCriterion(
        Task(dictionary), sentence_avg, EPSILON, ignore_prefix_size=prefix, aux_loss_weight=gamma)
    loss, sample_size, logs = criterion_(model, sample, reduce=False)
    target = sample["target"][:, prefix:]
    main, aux1, aux2 = [label_smoothed_ce(x[:, prefix:], target, EPSILON, dictionary.pad())
                        for x in decoder_logits(model, sample)]
    close(loss.detach().view(-1), main[0] + gamma * (aux1[0] + aux2[0]))
    close(logs["loss"].view(-1), main[0])
    close(logs["aux2_nll_loss"].view(-1), aux2[1])
    assert sample_size == logs["sample_size"] == (4 if sentence_avg else sample["ntokens"])
    assert sample["ntokens"] != 4 and logs["nsentences"] == 4


def test_reduced_losses_and_logs_are_the_summed_equation():
    """Eq. 4.1 summed over the target tokens, and the logged entries: the Main-Decoder's loss
    and nll, each auxiliary decoder's loss and nll (plain torch, float64)."""
    dictionary, gamma = toy_dictionary(), 0.5
    model = build_model("ms_transformer", *ms("1,2"), dictionary=dictionary).double().eval()
    sample = toy_sample(dictionary)
    loss, sample_size, logs = criterion(dictionary, gamma)(model, sample)
    main, aux1, aux2 = [[t.sum() for t in label_smoothed_ce(x, sample["target"], EPSILON, dictionary.pad())]
                        for x in decoder_logits(model, sample)]
    close(loss.detach(), main[0] + gamma * (aux1[0] + aux2[0]))
    expected = {"loss": main[0], "nll_loss": main[1], "aux1_loss": aux1[0], "aux1_nll_loss": aux1[1],
                "aux2_loss": aux2[0], "aux2_nll_loss": aux2[1], "joint_loss": main[0] + gamma * (aux1[0] + aux2[0])}
    assert set(logs) == set(expected) | {"ntokens", "nsentences", "sample_size"}
    for key, value in expected.items():
        close(logs[key], value, msg=key)
    assert sample_size == logs["sample_size"] == logs["ntokens"] == sample["ntokens"]


def test_default_arguments_are_the_command_line_defaults():
    """Built with the required arguments only, the criterion is the one of the command line's
    defaults: gamma = 1 (thesis Eq. 4.1, all its experiments) and no accuracy."""
    dictionary = toy_dictionary()
    model = build_model("ms_transformer", *ms("1"), dictionary=dictionary).double().eval()
    sample = toy_sample(dictionary)
    loss, _, logs = MultiDecoderLabelSmoothedCrossEntropyCriterion(Task(dictionary), False, EPSILON)(model, sample)
    main, aux = [label_smoothed_ce(x, sample["target"], EPSILON, dictionary.pad())[0].sum()
                 for x in decoder_logits(model, sample)]
    close(loss.detach(), main + 1.0 * aux)
    assert "n_correct" not in logs and "total" not in logs


def test_accuracy_is_the_main_decoders():
    """``--report-accuracy``: the Main-Decoder's argmax against the non-pad target tokens;
    the target is made to agree with the argmax on some tokens, so the count is not 0."""
    dictionary = toy_dictionary()
    model = build_model("ms_transformer", *ms("1"), dictionary=dictionary).double().eval()
    sample = toy_sample(dictionary)
    main, aux = decoder_logits(model, sample)
    predicted = main.argmax(-1)
    target = sample["target"]
    target[:, :2] = predicted[:, :2]
    target[:, 2:4] = (predicted[:, 2:4] - dictionary.nspecial + 1) % (len(dictionary) - dictionary.nspecial) \
        + dictionary.nspecial
    target[0, -2:] = dictionary.pad()
    non_pad = target.ne(dictionary.pad())
    expected_correct = int((predicted.eq(target) & non_pad).sum())
    assert 0 < expected_correct < int(non_pad.sum())
    assert expected_correct != int((aux.argmax(-1).eq(target) & non_pad).sum())
    criterion_ = MultiDecoderLabelSmoothedCrossEntropyCriterion(Task(dictionary), False, EPSILON,
                                                               report_accuracy=True)
    loss, _, logs = criterion_(model, sample)
    assert logs["n_correct"] == expected_correct and logs["total"] == int(non_pad.sum())
    losses = [label_smoothed_ce(x, target, EPSILON, dictionary.pad())[0].sum() for x in (main, aux)]
    close(loss.detach(), losses[0] + losses[1])  # the whole target


def test_a_model_without_auxiliary_decoders_gets_fairseqs_loss():
    """A model whose output has no auxiliary entries (fairseq's transformer): J = L_m, the
    loss and logs of fairseq's label-smoothed cross-entropy, and joint_loss = loss."""
    dictionary = toy_dictionary()
    model = build_model("transformer", dictionary=dictionary).double().eval()
    sample = toy_sample(dictionary)
    loss, sample_size, logs = criterion(dictionary, 1.0)(model, sample)
    fairseqs = LabelSmoothedCrossEntropyCriterion(Task(dictionary), False, EPSILON)(model, sample)
    torch.testing.assert_close(loss, fairseqs[0])
    assert sample_size == fairseqs[1]
    assert set(logs) == set(fairseqs[2]) | {"joint_loss"}
    for key, value in fairseqs[2].items():
        assert logs[key] == value, key
    torch.testing.assert_close(logs["joint_loss"], fairseqs[0].detach())


# --- logged metrics (fairseq.logging.metrics) ----------------------------------------------

def reduced(*calls):
    """The smoothed values after ``reduce_metrics`` of each list of logging outputs, in one
    aggregation (as fairseq logs several intervals of an epoch)."""
    with metrics.aggregate(new_root=True) as aggregation:
        for logging_outputs in calls:
            MultiDecoderLabelSmoothedCrossEntropyCriterion.reduce_metrics(logging_outputs)
        return aggregation.get_smoothed_values()


def f64(value):
    return torch.tensor(value, dtype=torch.float64)


# Two batches' logging outputs with --sentence-avg (sample size = sentences != tokens), and
# auxiliary decoders on encoder layers 1 and 3.
BATCHES = [
    {"loss": f64(10.0), "nll_loss": f64(8.0), "ntokens": 7, "nsentences": 2, "sample_size": 2,
     "aux1_loss": f64(12.0), "aux1_nll_loss": f64(9.0), "aux3_loss": f64(11.0), "aux3_nll_loss": f64(8.5),
     "joint_loss": f64(33.0)},
    {"loss": f64(6.0), "nll_loss": f64(5.0), "ntokens": 5, "nsentences": 3, "sample_size": 3,
     "aux1_loss": f64(7.0), "aux1_nll_loss": f64(6.0), "aux3_loss": f64(6.5), "aux3_nll_loss": f64(5.5),
     "joint_loss": f64(19.5)},
]


def expected_metrics(batches):
    """Base-2 losses: each loss summed over the batches over the summed sample size, each
    nll over the summed number of target tokens (fairseq's convention)."""
    sample_size = sum(b["sample_size"] for b in batches)
    ntokens = sum(b["ntokens"] for b in batches)
    total = {key: sum(float(b.get(key, 0)) for b in batches)
             for key in ("loss", "joint_loss", "aux1_loss", "aux3_loss", "aux1_nll_loss", "aux3_nll_loss")}
    return {
        "loss": total["loss"] / sample_size / math.log(2),
        "joint_loss": total["joint_loss"] / sample_size / math.log(2),
        "aux1_loss": total["aux1_loss"] / sample_size / math.log(2),
        "aux3_loss": total["aux3_loss"] / sample_size / math.log(2),
        "aux1_nll_loss": total["aux1_nll_loss"] / ntokens / math.log(2),
        "aux3_nll_loss": total["aux3_nll_loss"] / ntokens / math.log(2),
    }


def assert_logged(values, expected):
    for key, value in expected.items():
        assert round(value, 3) != round(value, 4), key  # the rounding to 3 digits is visible
        assert values[key] == pytest.approx(round(value, 3), abs=1e-9), key


def test_logged_joint_and_auxiliary_losses_are_base_2_per_sample_and_per_token():
    """joint_loss and aux<l>_loss: summed over batches / sample size / ln 2; aux<l>_nll_loss:
    / target tokens / ln 2; rounded to 3 digits like fairseq's loss."""
    values = reduced(BATCHES)
    assert_logged(values, expected_metrics(BATCHES))
    assert not any(re.fullmatch(r"aux(2|\d\d+).*", key) for key in values)


def test_two_logging_intervals_average_weighted_by_their_denominators():
    """Reducing the batches one at a time in one aggregation gives what reducing them
    together gives: each value is weighted by its sample size (nll: its tokens)."""
    values = reduced(BATCHES[:1], BATCHES[1:])
    assert_logged(values, expected_metrics(BATCHES))


def test_entries_missing_from_a_logging_output_count_as_zero():
    """As in fairseq's own reduce_metrics: an empty logging output changes nothing."""
    values = reduced(BATCHES + [{}])
    assert_logged(values, expected_metrics(BATCHES))


def test_nothing_but_fairseqs_metrics_for_a_zero_sample_size():
    empty = [{"loss": f64(0.0), "nll_loss": f64(0.0), "ntokens": 0, "nsentences": 0, "sample_size": 0,
              "aux1_loss": f64(0.0), "aux1_nll_loss": f64(0.0), "joint_loss": f64(0.0)}]
    values = reduced(empty)
    assert "loss" in values and not any(key.startswith(("aux", "joint")) for key in values)


@pytest.mark.parametrize("fusion", [[], ["--aux-fusion"]], ids=["MS-12", "MS-12+AIF"])
def test_every_parameter_gets_a_gradient_from_the_joint_loss(fusion):
    """The condition for DDP without find_unused_parameters (every parameter gets a gradient)."""
    dictionary = toy_dictionary()
    model = build_model("ms_transformer", *ms("1,2", *fusion), dictionary=dictionary)
    loss, _, _ = criterion(dictionary, 1.0)(model, toy_sample(dictionary))
    loss.backward()
    assert [name for name, p in model.named_parameters() if p.grad is None] == []


@pytest.mark.parametrize("fusion, flows", [([], False), (["--aux-fusion"], True)],
                         ids=["MS-1", "MS-1+AIF"])
def test_main_loss_reaches_the_auxiliary_decoders_only_through_aif(fusion, flows):
    dictionary = toy_dictionary()
    model = build_model("ms_transformer", *ms("1", *fusion), dictionary=dictionary)
    loss, _, _ = criterion(dictionary, 0.0)(model, toy_sample(dictionary))
    loss.backward()
    reached = [p.grad is not None and bool(p.grad.any()) for p in model.decoder.aux_decoders[0].layers.parameters()]
    assert all(reached) if flows else not any(reached)  # gamma = 0: zero gradients without AIF


# --- AIF --------------------------------------------------------------------------------------

@NORMS
def test_aif_with_zero_fusion_matrices_equals_the_model_without_aif(norm):
    dictionary = toy_dictionary()
    aif = build_model("ms_transformer", *ms("1,2", "--aux-fusion"), *norm, dictionary=dictionary).eval()
    plain = build_model("ms_transformer", *ms("1,2"), *norm, dictionary=dictionary).eval()
    plain.load_state_dict({k: v for k, v in aif.state_dict().items() if ".aux_fusion." not in k})
    src, lengths, prev = random_batch(dictionary)
    with torch.no_grad():
        fused, _ = aif(src, lengths, prev)
        expected, expected_extra = plain(src, lengths, prev)
        assert not torch.allclose(fused, expected, atol=1e-4)  # AIF does change the output
        for layer in aif.decoder.layers:
            layer.aux_fusion.proj.weight.zero_()
        got, extra = aif(src, lengths, prev)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    for (aux, _), (expected_aux, _) in zip(extra["aux_out"], expected_extra["aux_out"]):
        torch.testing.assert_close(aux, expected_aux, atol=1e-5, rtol=1e-5)


def test_zero_aif_option_is_the_ind_decoder():
    dictionary = toy_dictionary()
    aif = build_model("ms_transformer", *ms("1", "--aux-fusion"), dictionary=dictionary).eval()
    ind = build_model("ms_transformer", *ms("1", "--aux-fusion", "--zero-aif"), dictionary=dictionary).eval()
    ind.load_state_dict(aif.state_dict())
    src, lengths, prev = random_batch(dictionary)
    with torch.no_grad():
        for layer in aif.decoder.layers:
            layer.aux_fusion.proj.weight.zero_()
        torch.testing.assert_close(ind(src, lengths, prev)[0], aif(src, lengths, prev)[0])


def test_fusion_is_the_sum_over_auxiliary_decoders_of_f_times_w():
    """Eq. 4.2 with two auxiliary decoders: z^f = f^1 W^{a_1} + f^2 W^{a_2}."""
    dictionary = toy_dictionary()
    model = build_model("ms_transformer", *ms("1,2", "--aux-fusion"), dictionary=dictionary).eval()
    fusion = model.decoder.layers[0].aux_fusion
    f1, f2 = torch.randn(5, 3, D), torch.randn(5, 3, D)
    w1, w2 = fusion.weights()
    torch.testing.assert_close(fusion(torch.cat([f1, f2], dim=-1)), f1 @ w1 + f2 @ w2)


def test_fusion_dropout_is_applied_to_z_f_in_training():
    """``--aux-fusion-dropout p``: dropout on the fused vector z^f of every Main-Decoder layer
    (Eq. 4.2), during training only; the same random draw as ``F.dropout(z^f, p)``."""
    dictionary = toy_dictionary()
    model = build_model("ms_transformer", *ms("1,2", "--aux-fusion", "--aux-fusion-dropout", "0.25"),
                        dictionary=dictionary).train()
    f1, f2 = torch.randn(5, 3, D), torch.randn(5, 3, D)
    for layer in model.decoder.layers:
        w1, w2 = layer.aux_fusion.weights()
        torch.manual_seed(3)
        got = layer.aux_fusion(torch.cat([f1, f2], dim=-1))
        torch.manual_seed(3)
        expected = torch.nn.functional.dropout(f1 @ w1 + f2 @ w2, p=0.25, training=True)
        torch.testing.assert_close(got, expected)
        assert (got == 0).any()
    model.eval()
    layer = model.decoder.layers[0]
    w1, w2 = layer.aux_fusion.weights()
    torch.testing.assert_close(layer.aux_fusion(torch.cat([f1, f2], dim=-1)), f1 @ w1 + f2 @ w2)


# --- inference --------------------------------------------------------------------------------

@NORMS
@pytest.mark.parametrize("options", [ms("1"), ms("2", "--aux-fusion"), ms("1,2", "--aux-fusion"),
                                     ms("1,2", "--decode-from", "aux:2")],
                         ids=["MS-1", "MS-2+AIF", "MS-12+AIF", "decode-from-aux"])
def test_incremental_decoding_matches_full_forward(options, norm):
    dictionary = toy_dictionary()
    model = build_model("ms_transformer", *options, *norm, dictionary=dictionary)
    assert_incremental_matches_full(model, dictionary)


def test_beam_search_scores_match_the_full_forward_with_aif(monkeypatch):
    """The auxiliary decoders, run in lock-step for AIF, follow their hypotheses through beam
    search."""
    torch.manual_seed(0)
    dictionary = toy_dictionary()
    model = build_model("ms_transformer", *ms("1,2", "--aux-fusion"), dictionary=dictionary)
    assert_beam_search_scores_match_full(model, dictionary, monkeypatch)


@NORMS
def test_auxiliary_memories_are_the_chosen_encoder_layers_also_at_generation(norm):
    """fairseq's generator calls the encoder without return_all_hiddens."""
    dictionary = toy_dictionary()
    model = build_model("ms_transformer", *ms("1,2", "--aux-fusion"), *norm, dictionary=dictionary).eval()
    src, lengths, _ = random_batch(dictionary)
    with torch.no_grad():
        memories = model.encoder.forward_torchscript({"src_tokens": src, "src_lengths": lengths})["aux_memories"][0]
        states = model.encoder(src, src_lengths=lengths, return_all_hiddens=True)["encoder_states"]
    assert memories.shape[0] == 2
    norms = model.encoder.memories["aux_memories"].aux_layer_norms or [torch.nn.Identity()] * 2
    for index, layer in enumerate((1, 2)):
        torch.testing.assert_close(memories[index], norms[index](states[layer]))


@pytest.mark.parametrize("other", [["--decoder-cross-attention", "multi-layer"], ["--layer-aggregation", "s-agg"],
                                   ["--mlrf-decoder-fusion", "fnn"]], ids=["MLMHA", "S-Agg", "MLRF"])
def test_auxiliary_supervision_composes_with_other_mechanisms(other):
    dictionary = toy_dictionary()
    model = build_model("ms_transformer", *ms("1", "--aux-fusion"), *other, dictionary=dictionary)
    assert set(model.encoder.memories) >= {"aux_memories"} and len(model.encoder.memories) <= 2
    assert_incremental_matches_full(model, dictionary)


def count_aux_decoder_layer_calls(model):
    calls = []
    for aux in model.decoder.aux_decoders:
        for layer in aux.layers:
            layer.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


@pytest.mark.parametrize("fusion", [[], ["--aux-fusion"]], ids=["MS-12", "MS-12+AIF"])
def test_generation_runs_the_auxiliary_decoders_only_with_aif(fusion):
    dictionary = toy_dictionary()
    model = build_model("ms_transformer", *ms("1,2", *fusion), dictionary=dictionary).eval()
    calls = count_aux_decoder_layer_calls(model)
    src, lengths, _ = random_batch(dictionary)
    generator = SequenceGenerator([model], dictionary, beam_size=2, max_len_b=5, min_len=5)
    with torch.no_grad():
        hypotheses = generator.generate([model], {"net_input": {"src_tokens": src, "src_lengths": lengths}})
    assert all(len(h[0]["tokens"]) == 6 for h in hypotheses)
    steps = 6  # 5 tokens + EOS, one decoder call each
    assert len(calls) == (steps * 2 * DECODER_LAYERS if fusion else 0)  # 2 auxiliary decoders


def test_decode_from_an_auxiliary_decoder_gives_its_output():
    dictionary = toy_dictionary()
    model = build_model("ms_transformer", *ms("1,2", "--aux-fusion"), dictionary=dictionary).eval()
    aux2 = build_model("ms_transformer", *ms("1,2", "--aux-fusion", "--decode-from", "aux:2"),
                       dictionary=dictionary).eval()
    aux2.load_state_dict(model.state_dict())
    src, lengths, prev = random_batch(dictionary)
    with torch.no_grad():
        expected = model(src, lengths, prev)[1]["aux_out"][1][0]
        torch.testing.assert_close(aux2(src, lengths, prev)[0], expected)


def test_decode_from_passes_the_decoder_arguments_to_the_auxiliary_decoder():
    """``--decode-from aux:2`` with fairseq's decoder arguments (features only, an incremental
    state, the alignment layer): the result of fairseq's decoder stack of Aux-Decoder 2 called
    with them on its memory, the output of encoder layer 2."""
    dictionary = toy_dictionary()
    aux2 = build_model("ms_transformer", *ms("1,2", "--decode-from", "aux:2"), dictionary=dictionary).eval()
    src, lengths, prev = random_batch(dictionary)
    stack = aux2.decoder.aux_decoders[1]
    with torch.no_grad():
        encoder_out = aux2.encoder(src, src_lengths=lengths)
        memory = {**encoder_out, "encoder_out": [encoder_out["aux_memories"][0][1]]}
        torch.testing.assert_close(memory["encoder_out"][0],
                                   aux2.encoder(src, src_lengths=lengths, return_all_hiddens=True)["encoder_states"][2])
        got, got_extra = aux2.decoder(prev, encoder_out, features_only=True, alignment_layer=0)
        expected, expected_extra = stack(prev, encoder_out=memory, features_only=True, alignment_layer=0)
        state, stack_state = {}, {}
        step = aux2.decoder(prev[:, :1], encoder_out, incremental_state=state)[0]
        stack_step = stack(prev[:, :1], encoder_out=memory, incremental_state=stack_state)[0]
    assert got.shape[-1] == D and torch.equal(got, expected)
    assert torch.equal(got_extra["attn"][0], expected_extra["attn"][0])
    assert torch.equal(step, stack_step) and state.keys() == stack_state.keys() != set()


def ms1_and_slot_model():
    """MS-1 (no AIF) and the slot Transformer with MS-1's weights less its auxiliary decoder:
    the same Main-Decoder, both in eval mode."""
    dictionary = toy_dictionary()
    model = build_model("ms_transformer", *ms("1"), dictionary=dictionary).eval()
    slot = build_model("slot_transformer", dictionary=dictionary).eval()
    slot.load_state_dict({k: v for k, v in model.state_dict().items() if ".aux_decoders." not in k})
    return dictionary, model, slot


@ALIGNMENT_OPTIONS
def test_main_decoder_features_take_fairseqs_alignment_arguments(options):
    """The Main-Decoder's ``extract_features`` called directly (without AIF the auxiliary
    decoders do not change it): the slot Transformer's with the same weights, for the default
    and the given alignment arguments."""
    dictionary, model, slot = ms1_and_slot_model()
    src, lengths, prev = random_batch(dictionary)
    with torch.no_grad():
        encoder_out = model.encoder(src, src_lengths=lengths)
    assert_features_match_with_alignment_options(slot.decoder, model.decoder, prev, encoder_out, options)


def test_main_decoder_forward_takes_fairseqs_decoder_arguments():
    """The model's forward with fairseq's decoder arguments: ``features_only`` gives the
    Main-Decoder's features (the slot Transformer's with the same weights, without AIF) and
    no auxiliary logits; ``alignment_layer``/``alignment_heads`` reach the Main-Decoder's
    layers."""
    dictionary, model, slot = ms1_and_slot_model()
    src, lengths, prev = random_batch(dictionary)
    with torch.no_grad():
        features, extra = model(src, lengths, prev, features_only=True)
        expected_features, _ = slot(src, lengths, prev, features_only=True)
        logits, aligned = model(src, lengths, prev, alignment_layer=0, alignment_heads=1)
        expected_logits, expected_aligned = slot(src, lengths, prev, alignment_layer=0, alignment_heads=1)
        _, last = slot(src, lengths, prev)
    assert features.shape[-1] == D and torch.equal(features, expected_features)
    assert "aux_out" not in extra and "aux_states" not in extra
    assert torch.equal(logits, expected_logits) and len(aligned["aux_out"]) == 1
    assert torch.equal(aligned["attn"][0], expected_aligned["attn"][0])
    assert not torch.allclose(aligned["attn"][0], last["attn"][0])


def test_decoding_steps_return_no_auxiliary_outputs():
    """Incremental decoding with AIF runs the auxiliary decoders (their features feed AIF) but
    projects none of them to the vocabulary: a step's extra holds no auxiliary entries."""
    dictionary = toy_dictionary()
    model = build_model("ms_transformer", *ms("1,2", "--aux-fusion"), dictionary=dictionary).eval()
    calls = count_aux_decoder_layer_calls(model)
    src, lengths, prev = random_batch(dictionary)
    with torch.no_grad():
        _, extra = model.decoder(prev[:, :1], model.encoder(src, src_lengths=lengths), incremental_state={})
    assert len(calls) == 2 * DECODER_LAYERS
    assert not {"aux_out", "aux_layers", "aux_states"} & set(extra)


def test_aif_main_decoder_layers_take_the_decoder_slot_fillers_of_their_index():
    """The Main-Decoder's AIF layers are slot layers built with their own index: a per-layer
    decoder mechanism (the Dual Contextual module on decoder layer 2) lands in that layer of
    the Main-Decoder only (the auxiliary decoders are fairseq's stacks)."""
    from mlmha_fairseq.models.multi_level_supervision import AIFStep
    from mlmha_fairseq.modules.dual_contextual import DualContextual

    model = build_model("ms_transformer", *ms("1", "--aux-fusion"), "--dc-decoder-layers", "2")
    main = model.decoder.layers
    assert all(isinstance(layer.aux_fusion, AIFStep) for layer in main)
    assert [isinstance(layer.self_attn, DualContextual) for layer in main] == [False, True]
    assert not any(isinstance(layer.self_attn, DualContextual) for layer in model.decoder.aux_decoders[0].layers)


# --- parameters and sharing (thesis §4.2) ----------------------------------------------------

@NORMS
@pytest.mark.parametrize("layers", ["1", "1,2"])
def test_each_auxiliary_decoder_adds_one_decoder_stack_and_aif_adds_l_d_squared(layers, norm):
    num_aux = len(layers.split(","))
    baseline = num_params(build_model("slot_transformer", *norm))
    plain = num_params(build_model("ms_transformer", *ms(layers), *norm))
    fused = num_params(build_model("ms_transformer", *ms(layers, "--aux-fusion"), *norm))
    assert plain - baseline == num_aux * decoder_stack_params(bool(norm))
    assert fused - plain == num_aux * DECODER_LAYERS * D * D


def test_thesis_small_model_parameter_counts():
    """Thesis Table 4.6a (baseline 12.8 M, MS-i 17.0 M, MS-i+AIF 17.3 M): an auxiliary decoder of
    the small model adds 4,205,568 parameters with the thesis' bias-free attention (+ fairseq's
    8d attention biases per layer here; in the preset's pre-norm also its final LayerNorm and
    its memory's LayerNorm, 2 x 2d), AIF adds 4 x 256^2 = 262,144 per auxiliary decoder."""
    dictionary = toy_dictionary([f"w{i}" for i in range(100)])
    sizes = ["--encoder-layers", "4", "--decoder-layers", "4", "--encoder-embed-dim", "256",
             "--decoder-embed-dim", "256", "--encoder-ffn-embed-dim", "1024",
             "--decoder-ffn-embed-dim", "1024", "--encoder-attention-heads", "4",
             "--decoder-attention-heads", "4"]
    pre_norm = ["--encoder-normalize-before", "--decoder-normalize-before"]
    for arch, norm, layer_norms in (("ms_transformer_iwslt", pre_norm, 2 * 2 * 256),
                                    ("ms_transformer_iwslt_post_norm", [], 0)):
        baseline = num_params(build_model("slot_transformer", *sizes, *norm, "--share-all-embeddings",
                                          dictionary=dictionary))
        model = build_model(arch, *sizes, dictionary=dictionary)
        assert model.decoder.aux_layers == [3] and model.decoder.aux_fusion
        assert num_params(model) - baseline == 4_205_568 + 4 * 8 * 256 + layer_norms + 262_144


@pytest.mark.parametrize("share", [["--share-decoder-input-output-embed"], ["--share-all-embeddings"], []])
def test_auxiliary_decoders_share_embeddings_and_output_projection(share):
    model = build_model("ms_transformer", *ms("1,2"), *share)
    main = model.decoder
    for aux in main.aux_decoders:
        assert aux.embed_tokens.weight is main.embed_tokens.weight
        assert aux.output_projection.weight is main.output_projection.weight
        assert aux.embed_positions is main.embed_positions
        assert aux.dictionary is main.dictionary  # a complete fairseq decoder over the target vocabulary
        assert aux.layers[0].self_attn.q_proj.weight is not main.layers[0].self_attn.q_proj.weight
    if share == ["--share-all-embeddings"]:
        assert model.encoder.embed_tokens.weight is main.aux_decoders[0].output_projection.weight


def test_presets():
    iwslt = build_model("ms_transformer_iwslt")  # tiny sizes: a 3-layer encoder -> layer L-1 = 2
    assert iwslt.decoder.aux_layers == [2] and iwslt.decoder.aux_fusion
    wmt = build_model("ms_transformer_wmt_en_de")
    assert wmt.decoder.aux_layers == [1] and wmt.decoder.aux_fusion
    plain = build_model("ms_transformer_iwslt", "--no-aux-fusion")
    assert not plain.decoder.aux_fusion and not hasattr(plain.decoder.layers[0], "aux_fusion")


@pytest.mark.parametrize(
    "options, message",
    [
        (ms("3"), r"attach to encoder layers 1\.\.2 \(layer 3 feeds the main decoder\)"),
        (ms("0"), "attach to encoder layers 1..2"),
        (ms("1,1"), "listed twice"),
        (ms("one"), "expected comma-separated encoder layer numbers"),
        (ms("none", "--aux-fusion"), "--aux-fusion needs auxiliary decoders"),
        (ms("1", "--zero-aif"), "--zero-aif needs --aux-fusion"),
        (ms("1", "--decode-from", "aux:2"), "choose one of main, aux:1"),
        (ms("1", "--decode-from", "aux"), "choose one of main, aux:1"),
        (ms("1", "--no-cross-attention"), "^--aux-decoder-layers 1: auxiliary decoders attend to encoder layers: "
                                          "they cannot be used with --no-cross-attention$"),
        (ms("1,2", "--no-cross-attention"), "^--aux-decoder-layers 1,2: auxiliary decoders attend"),
        (ms("1", "--adaptive-softmax-cutoff", "10"), "^--aux-decoder-layers 1: auxiliary decoders share the output "
                                                     "projection, which --adaptive-softmax-cutoff replaces: use a "
                                                     "plain softmax$"),
        (ms("1", "--aux-fusion", "--decoder-output-dim", "8"),
         "^--aux-fusion needs --decoder-output-dim == --decoder-embed-dim$"),
    ],
)
def test_bad_configurations_are_refused_with_a_clear_message(options, message):
    with pytest.raises(ValueError, match=message):
        build_model("ms_transformer", *options)


@pytest.mark.parametrize("options", [ms("none", "--no-cross-attention"), ms("none", "--adaptive-softmax-cutoff", "10"),
                                     ms("1", "--decoder-output-dim", "8")],
                         ids=["no-cross-attention", "adaptive-softmax", "output-dim"])
def test_what_only_auxiliary_decoders_or_aif_forbid_is_allowed_without_them(options):
    """The refusals above apply only where they matter: without auxiliary decoders, and an
    output dimension other than d without AIF (the auxiliary decoders project their own
    features like the Main-Decoder). The Main-Decoder is then the slot Transformer's with
    the same options (e.g. no cross-attention in its layers)."""
    dictionary = toy_dictionary()
    model = build_model("ms_transformer", *options, dictionary=dictionary).eval()
    slot = build_model("slot_transformer", *options[2:], dictionary=dictionary).eval()
    slot.load_state_dict({k: v for k, v in model.state_dict().items() if ".aux_decoders." not in k})
    src, lengths, prev = random_batch(dictionary)
    with torch.no_grad():
        logits, extra = model(src, lengths, prev)
        expected = slot(src, lengths, prev)[0]
    assert torch.equal(logits, expected)
    assert len(model.decoder.aux_decoders) == len(extra["aux_out"]) == (options[1] != "none")
    for aux_logits, _ in extra["aux_out"]:
        assert aux_logits.shape == logits.shape


# --- command line: training, strip, analysis, distributed -------------------------------------

@pytest.fixture(scope="module")
def trained(data_bin, tmp_path_factory):
    """Checkpoints of MS-1 and MS-1+AIF after a few updates with the joint loss."""
    root = tmp_path_factory.mktemp("ms")
    logs = {}
    for name, fusion in (("ms1", []), ("ms1_aif", ["--aux-fusion"])):
        result = run_fairseq("train", *train_args(data_bin, root / name, "ms_transformer",
                                                  *ms("1", *fusion), *CRITERION))
        logs[name] = result.stdout + result.stderr
    return root, logs


def test_training_logs_main_auxiliary_and_joint_losses(trained):
    _, logs = trained
    valid = [line for line in logs["ms1"].splitlines() if "| valid on" in line]
    assert valid and all(key in valid[-1] for key in ("| loss ", "| aux1_loss ", "| aux1_nll_loss ",
                                                        "| joint_loss "))
    main = float(re.search(r"\| loss ([\d.]+)", valid[-1]).group(1))
    aux = float(re.search(r"\| aux1_loss ([\d.]+)", valid[-1]).group(1))
    joint = float(re.search(r"\| joint_loss ([\d.]+)", valid[-1]).group(1))
    assert math.isclose(joint, main + aux, abs_tol=2e-3)


def load(path, **overrides):
    models, _, _ = checkpoint_utils.load_model_ensemble_and_task([str(path)], arg_overrides=overrides or None)
    return models[0].eval()


def test_stripped_checkpoint_decodes_like_the_full_one(trained, data_bin, tmp_path, caplog):
    root, _ = trained
    stripped = tmp_path / "deploy.pt"
    strip_aux_decoders.main([str(root / "ms1" / "checkpoint_last.pt"), str(stripped)])
    logging.getLogger().addHandler(caplog.handler)  # the tool's logging set-up removed pytest's
    try:
        full, small = load(root / "ms1" / "checkpoint_last.pt"), load(stripped)
    finally:
        logging.getLogger().removeHandler(caplog.handler)
    # the options recorded in the state dict follow the stripped ones: no warning of other options
    assert not [record for record in caplog.records if "other options" in record.getMessage()]
    assert len(small.decoder.aux_decoders) == 0 and len(small.encoder.memories) == 0
    assert num_params(full) - num_params(small) == decoder_stack_params(False)
    dictionary = small.decoder.dictionary
    src, lengths, prev = random_batch(dictionary)
    with torch.no_grad():
        torch.testing.assert_close(small(src, lengths, prev)[0], full(src, lengths, prev)[0])


def test_strip_refuses_an_aif_checkpoint(trained, tmp_path, capsys):
    root, _ = trained
    with pytest.raises(SystemExit) as error:
        strip_aux_decoders.main([str(root / "ms1_aif" / "checkpoint_last.pt"), str(tmp_path / "x.pt")])
    assert error.value.code == 2
    assert "uses AIF" in capsys.readouterr().err
    assert not (tmp_path / "x.pt").exists()


def test_decode_from_override_loads_an_auxiliary_decoder(trained):
    root, _ = trained
    path = root / "ms1_aif" / "checkpoint_last.pt"
    main, aux = load(path), load(path, decode_from="aux:1")
    assert aux.decoder.decode_from == 0
    src, lengths, prev = random_batch(main.decoder.dictionary)
    with torch.no_grad():
        torch.testing.assert_close(aux(src, lengths, prev)[0], main(src, lengths, prev)[1]["aux_out"][0][0])


def test_aif_dependency_is_zero_for_zero_fusion_weights():
    dictionary = toy_dictionary()
    model = build_model("ms_transformer", *ms("1", "--aux-fusion"), dictionary=dictionary).eval()
    src, lengths, _ = random_batch(dictionary)
    tokens = [row[row.ne(dictionary.pad())] for row in src]
    result = aif_dependency(model, batches(tokens, dictionary, 2), dictionary, 0, 4)
    assert result.output_divergence() > 0 and (result.layer_divergence() > 0).all()
    assert len(result.sentence_divergences) == 4
    with torch.no_grad():
        for layer in model.decoder.layers:
            layer.aux_fusion.proj.weight.zero_()
    zero = aif_dependency(model, batches(tokens, dictionary, 2), dictionary, 0, 4)
    assert zero.output_divergence() == pytest.approx(0, abs=1e-9)
    assert zero.layer_divergence() == pytest.approx(0, abs=1e-9)


def test_kl_divergence():
    p, q = torch.tensor([[0.5, 0.5, 0.0]]), torch.tensor([[0.25, 0.25, 0.5]])
    assert kl_divergence(p, q).item() == pytest.approx(math.log(2))
    assert kl_divergence(q, q).item() == 0


def test_aif_dependency_cli_writes_json_csv_png(trained, data_bin, tmp_path):
    root, _ = trained
    prefix = tmp_path / "out" / "aif"
    aif_dependency_cli.main([str(root / "ms1_aif" / "checkpoint_last.pt"), "--names", "MS-1+AIF",
                             "--data-bin", str(data_bin), "--split", "test", "--sample", "4",
                             "--per-token", "--output-prefix", str(prefix)])
    result = json.loads(prefix.with_suffix(".json").read_text())["models"]["MS-1+AIF"]
    assert result["sentences"] == 4 and len(result["attention_kl_per_layer"]) == DECODER_LAYERS
    assert result["per_token"][0]["tokens"][-1] == "</s>"
    assert len(prefix.with_suffix(".csv").read_text().splitlines()) == 1 + DECODER_LAYERS * 2  # 2 heads
    assert prefix.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_two_cpu_ranks_train_auxiliary_decoders_with_aif(data_bin, tmp_path):
    """Auxiliary decoders and AIF under DDP; that every parameter gets a gradient (no unused
    parameters, also without AIF) is tested above."""
    assert_ranks_identical_after_training(data_bin, tmp_path, "ms_transformer", *ms("1,2", "--aux-fusion"),
                                          *CRITERION)


@NORMS
def test_aif_uses_no_hooks_and_no_state_on_the_layers(norm):
    """AIF is the staged layer's step after self-attention: the model registers no forward
    hooks and its layers keep no per-call attributes."""
    model = build_model("ms_transformer", "--aux-decoder-layers", "1,2", "--aux-fusion", *norm)
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks, type(module).__name__
    assert not any(hasattr(layer, "aux_features") for layer in model.decoder.layers)
