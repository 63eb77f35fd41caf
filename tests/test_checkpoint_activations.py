"""fairseq's activation checkpointing (``--checkpoint-activations``, ``--offload-activations``)
on every architecture of the package, generated from fairseq's registry: the same loss and the
same gradient for every parameter as without it. fairseq's wrapper recomputes each layer in the
backward pass from the layer's top-level tensor arguments only; per-call inputs of the layers
that it did not see as such (AIF's auxiliary features, the multi-source memories, inside other
objects) made the backward pass fail ("Trying to backward through the graph a second time").

The command-line round trips of the two architectures that crashed: here (ms_transformer with
AIF) and in tests/test_multi_source.py (serial combination, on that file's N-way corpus)."""
import pytest
import torch
import torch.nn.functional as F
from fairseq.models import ARCH_MODEL_REGISTRY

from fairseq_helpers import assert_round_trip, build_model, random_batch
from mechanisms import MECHANISMS
from test_multi_source import build_multi_source, multi_source_batch

import mlmha_fairseq  # noqa: F401  (registers the architectures)
from mlmha_fairseq.modules.input_combination import SERIAL, STRATEGIES

PACKAGE_ARCHS = sorted(arch for arch, model in ARCH_MODEL_REGISTRY.items()
                       if model.__module__.startswith("mlmha_fairseq."))
MULTI_SOURCE_ARCHS = [arch for arch in PACKAGE_ARCHS if getattr(ARCH_MODEL_REGISTRY[arch], "is_multi_source", False)]
# Every architecture at its preset, the strategies the multi-source presets leave at their
# default, and the mechanisms' systems (tests/mechanisms.py) that the presets do not switch on.
CASES = {
    **{arch: [arch] for arch in PACKAGE_ARCHS},
    **{f"multi_source_transformer {strategy}": ["multi_source_transformer", "--combination-strategy", strategy]
       for strategy in STRATEGIES if strategy != SERIAL},
    **MECHANISMS,
}
FLAGS = {"checkpoint": ["--checkpoint-activations"], "offload": ["--offload-activations"]}
# Recomputation replays the forward's random numbers, so dropout would agree too; without it
# the comparison does not rest on that.
NO_DROPOUT = ["--dropout", "0", "--attention-dropout", "0", "--activation-dropout", "0"]
# Two text sources of different lengths and image features: both kinds of encoder.
SOURCES, IMAGE_SOURCES, KINDS = ["s1", "s2", "img"], ["img"], ["text", "text", "image"]


def build(arch, *options):
    """(model, loss of a random batch in training mode) for ``arch`` with ``options``."""
    torch.manual_seed(0)
    if getattr(ARCH_MODEL_REGISTRY[arch], "is_multi_source", False):
        model, task = build_multi_source(SOURCES, "--arch", arch, *NO_DROPOUT, *options, image_sources=IMAGE_SOURCES)
        inputs, lengths, prev = multi_source_batch(task.source_dictionary, KINDS)
        net_input = dict(src_tokens=inputs[0], src_lengths=lengths[0], multi_source_inputs=inputs,
                         multi_source_lengths=lengths)
    else:
        model = build_model(arch, *NO_DROPOUT, *options)
        src, lengths, prev = random_batch(model.decoder.dictionary)
        net_input = dict(src_tokens=src, src_lengths=lengths)
    return model, net_input, prev


def loss_of(model, net_input, prev):
    """Cross-entropy of the next tokens, plus every auxiliary decoder's (the joint loss with
    gamma 1), so that the auxiliary decoders' parameters get a gradient also without AIF."""
    model.train()
    logits, extra = model(prev_output_tokens=prev, **net_input)
    target = torch.roll(prev, -1, dims=1).flatten()
    outputs = [logits] + [aux_logits for aux_logits, _ in extra.get("aux_out", [])]
    return sum(F.cross_entropy(output.flatten(0, 1), target) for output in outputs)


def loss_and_gradients(model, net_input, prev):
    model.zero_grad()
    loss = loss_of(model, net_input, prev)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("flag", FLAGS.values(), ids=FLAGS.keys())
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_checkpoint_activations_give_the_loss_and_gradients_of_training_without(case, flag):
    arch, *options = case
    reference, net_input, prev = build(arch, *options)
    checkpointed, _, _ = build(arch, *options, *flag)
    checkpointed.load_state_dict(reference.state_dict())
    wrapped = {module for module in checkpointed.modules() if hasattr(module, "precheckpoint_forward")}
    assert set(checkpointed.decoder.layers) <= wrapped, "the decoder layers are not checkpointed"
    expected_loss, expected = loss_and_gradients(reference, net_input, prev)
    loss, got = loss_and_gradients(checkpointed, net_input, prev)
    torch.testing.assert_close(loss, expected_loss)
    assert got.keys() == expected.keys()
    for name, grad in expected.items():
        assert grad is not None, f"{name}: no gradient without checkpointing"
        assert got[name] is not None, f"{name}: no gradient with {' '.join(flag)}"
        torch.testing.assert_close(got[name], grad, msg=lambda m: f"{name}: {m}")


def test_checkpoint_activations_round_trip_ms_transformer_with_aif(data_bin, tmp_path):
    """fairseq-train --checkpoint-activations (3 updates, joint loss) -> fairseq-generate."""
    assert_round_trip(data_bin, tmp_path, "ms_transformer", "--aux-decoder-layers", "1", "--aux-fusion",
                      "--criterion", "multi_decoder_label_smoothed_cross_entropy", "--checkpoint-activations")
