"""The multi-decoder joint loss of encoder-based multi-level supervision (thesis Eq. 4.1).

    J(Y|X) = L_m(Y|X) + gamma * sum_{l in A} L_{a_l}(Y|X),    gamma = 1 in the thesis,

every ``L`` being fairseq's token-level label-smoothed cross-entropy against the same gold
target with teacher forcing; [choice] the thesis gives one smoothing value, used here for
every decoder. Summed over tokens and normalised by the number of target tokens like
fairseq's criterion, i.e. ``sum over decoders and tokens / #non-pad tokens``.

Logged: ``loss`` and ``nll_loss`` are the **Main-Decoder's** (so fairseq's default
``--best-checkpoint-metric loss`` selects checkpoints on the main decoder, the one that
translates; the thesis does not say which loss selects them),
``joint_loss`` is the optimised J, and ``aux<l>_loss`` / ``aux<l>_nll_loss`` are those of the
auxiliary decoder on encoder layer l.
"""
import math
import re
from dataclasses import dataclass, field

from fairseq import utils
from fairseq.criterions import register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    LabelSmoothedCrossEntropyCriterionConfig,
)
from fairseq.logging import metrics

from ..errors import UsageError
from ..models.multi_level_supervision import AUX_LAYERS, AUX_OUT

JOINT_LOSS = "joint_loss"
AUX_METRIC = re.compile(r"aux(\d+)_loss")


@dataclass
class MultiDecoderLabelSmoothedCrossEntropyConfig(LabelSmoothedCrossEntropyCriterionConfig):
    aux_loss_weight: float = field(
        default=1.0,
        metadata={"help": "gamma of the joint loss: weight of the sum of the auxiliary "
                          "decoders' losses (thesis Eq. 4.1; 1 in all its experiments)"},
    )


@register_criterion(
    "multi_decoder_label_smoothed_cross_entropy",
    dataclass=MultiDecoderLabelSmoothedCrossEntropyConfig,
)
class MultiDecoderLabelSmoothedCrossEntropyCriterion(LabelSmoothedCrossEntropyCriterion):
    """Main loss plus gamma times the auxiliary decoders' label-smoothed losses (Eq. 4.1),
    for models whose decoder returns ``extra["aux_out"]`` (``ms_transformer``)."""

    def __init__(self, task, sentence_avg, label_smoothing, ignore_prefix_size=0,
                 report_accuracy=False, aux_loss_weight=1.0):
        super().__init__(task, sentence_avg, label_smoothing, ignore_prefix_size, report_accuracy)
        if aux_loss_weight < 0:
            raise UsageError(f"--aux-loss-weight {aux_loss_weight} must be >= 0")
        self.aux_loss_weight = aux_loss_weight

    def forward(self, model, sample, reduce=True):
        net_output = model(**sample["net_input"])
        loss, nll_loss = self.compute_loss(model, net_output, sample, reduce=reduce)
        sample_size = sample["target"].size(0) if self.sentence_avg else sample["ntokens"]
        logging_output = {
            "loss": loss.data,
            "nll_loss": nll_loss.data,
            "ntokens": sample["ntokens"],
            "nsentences": sample["target"].size(0),
            "sample_size": sample_size,
        }
        joint = loss
        extra = net_output[1]
        for layer, aux_output in zip(extra.get(AUX_LAYERS, []), extra.get(AUX_OUT, [])):
            aux_loss, aux_nll_loss = self.compute_loss(model, aux_output, sample, reduce=reduce)
            joint = joint + self.aux_loss_weight * aux_loss
            logging_output[f"aux{layer}_loss"] = aux_loss.data
            logging_output[f"aux{layer}_nll_loss"] = aux_nll_loss.data
        logging_output[JOINT_LOSS] = joint.data
        if self.report_accuracy:
            n_correct, total = self.compute_accuracy(model, net_output, sample)
            logging_output["n_correct"] = utils.item(n_correct.data)
            logging_output["total"] = utils.item(total.data)
        return joint, sample_size, logging_output

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        """fairseq's metrics of the main decoder, plus the joint loss and each auxiliary
        decoder's loss and nll (base 2, per token, as fairseq logs them)."""
        super().reduce_metrics(logging_outputs)
        sample_size = sum(log.get("sample_size", 0) for log in logging_outputs)
        ntokens = sum(log.get("ntokens", 0) for log in logging_outputs)
        if not sample_size:
            return
        _log(JOINT_LOSS, logging_outputs, sample_size)
        layers = sorted({int(match.group(1)) for log in logging_outputs for key in log
                         if (match := AUX_METRIC.fullmatch(key))})
        for layer in layers:
            _log(f"aux{layer}_loss", logging_outputs, sample_size)
            _log(f"aux{layer}_nll_loss", logging_outputs, ntokens)


def _log(key: str, logging_outputs, denominator) -> None:
    total = sum(log.get(key, 0) for log in logging_outputs)
    metrics.log_scalar(key, total / denominator / math.log(2), denominator, round=3)
