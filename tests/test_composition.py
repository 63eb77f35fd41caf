"""Mechanisms of different models composed in one model (issue 30): multi-level supervision and
AIF (thesis ch. 4) on the multi-source Transformer (Libovický et al. 2018), AIF with Dec-DC."""
import pytest
import torch

from fairseq_helpers import (
    NORMS,
    assert_incremental_matches_full,
    build_model,
    run_fairseq,
    toy_dictionary,
    train_args,
)
from mlmha_fairseq.errors import UsageError
from mlmha_fairseq.models.multi_level_supervision import AUX_MEMORIES, AUX_OUT, AIFStep
from mlmha_fairseq.modules.dual_contextual import DualContextual
from test_multi_source import (
    DECODER_LAYERS,
    KINDS,
    assert_generates_the_test_set,
    assert_multi_source_incremental_matches_full,
    build_multi_source,
    forward,
    multi_source_batch,
    n_way_bin,  # noqa: F401 (the module-scoped fixture of the corpus)
    num_params,
    task_options,
)

D, FFN = 16, 32  # tests/fairseq_helpers.TINY_MODEL_ARGS
CRITERION = ["--criterion", "multi_decoder_label_smoothed_cross_entropy", "--label-smoothing", "0.1"]


def aux(layers="1", *extra):
    return ["--aux-decoder-layers", layers, *extra]


# --- multi-level supervision and AIF on the multi-source model ------------------------------

@pytest.mark.parametrize("strategy", ["serial", "hierarchical"])
@pytest.mark.parametrize("sources", KINDS, ids=list(KINDS))
@NORMS
def test_aif_on_multi_source_decodes_incrementally_as_the_full_forward(strategy, sources, norm):
    """AIF's auxiliary decoders run in lock-step with the combining Main-Decoder; their caches
    and memories follow the beam as the sources do."""
    names, images = KINDS[sources]
    model, task = build_multi_source(names, "--combination-strategy", strategy, *aux("1,2", "--aux-fusion"),
                                     *norm, image_sources=images)
    assert len(model.decoder.aux_decoders) == 2
    assert_multi_source_incremental_matches_full(model, task)


def test_a_full_forward_returns_the_auxiliary_outputs_on_the_primary_source():
    """The auxiliary decoder attends to layer 1 of the primary source's encoder: its output
    changes with the primary source only."""
    model, task = build_multi_source(["a", "b"], "--primary-source", "b", *aux("1"))
    model.eval()
    inputs, lengths, prev = multi_source_batch(task.dictionary, task.source_kinds)
    with torch.no_grad():
        (logits, _), = forward(model, inputs, lengths, prev, primary=1)[1][AUX_OUT]
        other = [inputs[0].flip(0), inputs[1]], [lengths[0].flip(0), lengths[1]]
        (same, _), = forward(model, *other, prev, primary=1)[1][AUX_OUT]
    assert logits.shape == (4, prev.size(1), len(task.dictionary))
    torch.testing.assert_close(same, logits)


@NORMS
@pytest.mark.parametrize("layers", ["1", "1,2"])
def test_parameters_are_the_multi_source_models_plus_the_auxiliary_decoders_and_aif(layers, norm):
    """Each auxiliary decoder adds one decoder stack of the Main-Decoder's shape (it shares the
    embeddings and the output projection; in pre-norm it adds its final LayerNorm and its
    memory's LayerNorm, in the primary encoder only); AIF one bias-free d x d matrix per
    Main-Decoder layer and auxiliary decoder (thesis Eq. 4.2)."""
    num_aux = len(layers.split(","))
    attention = 4 * (D * D + D)
    stack = DECODER_LAYERS * (2 * attention + (D * FFN + FFN) + (FFN * D + D) + 3 * 2 * D)
    stack += 2 * 2 * D if norm else 0
    sources = (["a", "b", "c"], "--primary-source", "b")
    plain = num_params(build_multi_source(*sources, *norm)[0])
    supervised, _ = build_multi_source(*sources, *aux(layers), *norm)
    fused = num_params(build_multi_source(*sources, *aux(layers, "--aux-fusion"), *norm)[0])
    assert num_params(supervised) - plain == num_aux * stack
    assert fused - num_params(supervised) == num_aux * DECODER_LAYERS * D * D
    assert [AUX_MEMORIES in encoder.memories for encoder in supervised.encoder.encoders] == [False, True, False]


def test_without_auxiliary_decoders_the_multi_source_model_is_unchanged():
    """The option's default on this model is none: the state dict of before."""
    model, _ = build_multi_source(["a", "b"])
    assert not hasattr(model.decoder, "aux_decoders")
    assert model.args.aux_decoder_layers == "none" and not model.args.aux_fusion


def test_auxiliary_decoders_with_an_adaptive_softmax_are_refused_on_multi_source_in_one_line():
    """The auxiliary decoders share the Main-Decoder's output projection, which an adaptive
    softmax replaces. (An image primary source, whose "encoder" has no layers for an auxiliary
    decoder, cannot be asked for: the task makes the primary source a text source.)"""
    with pytest.raises(UsageError, match="^--aux-decoder-layers 1: auxiliary decoders share the output "
                                         "projection, which --adaptive-softmax-cutoff replaces: use a plain softmax$"):
        build_multi_source(["a", "img"], *aux("1", "--aux-fusion"), "--adaptive-softmax-cutoff", "10",
                           image_sources=("img",))


def test_aif_on_multi_source_trains_with_the_joint_loss_and_decodes(n_way_bin, tmp_path):  # noqa: F811
    """fairseq-train (3 updates, the joint criterion) -> fairseq-generate, with a text and an
    image source beside the primary one."""
    options_ = task_options("s1,s2,img", "--image-sources", "img")
    result = run_fairseq("train", *train_args(n_way_bin, tmp_path, "multi_source_transformer", *options_,
                                              *aux("1", "--aux-fusion"), *CRITERION))
    assert "aux1_loss" in result.stdout + result.stderr
    assert_generates_the_test_set(n_way_bin, tmp_path / "checkpoint_last.pt", *options_)


# --- AIF with Dec-DC (both in the Main-Decoder's layers) ------------------------------------

@NORMS
def test_aif_and_decoder_dual_contextual_compose(norm):
    """Dec-DC fills the decoder self-attention slot, AIF the stage after it."""
    dictionary = toy_dictionary()
    model = build_model("ms_transformer", *aux("1,2", "--aux-fusion"), "--dc-decoder-layers", "all", *norm,
                        dictionary=dictionary)
    layer = model.decoder.layers[0]
    assert isinstance(layer.self_attn, DualContextual) and isinstance(layer.aux_fusion, AIFStep)
    assert_incremental_matches_full(model, dictionary)
