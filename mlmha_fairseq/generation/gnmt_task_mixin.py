"""A task mixin exposing the GNMT length penalty as ``--gnmt-lenpen ALPHA``.

Use it by putting :class:`GNMTLengthPenaltyMixin` before the fairseq task in the bases and
:class:`GNMTLengthPenaltyConfig` among the bases of the task's config dataclass (see
``mlmha_fairseq/tasks/translation_gnmt.py``). With the option unset, generation is
fairseq's unchanged.
"""
from dataclasses import dataclass, field
from typing import Optional

from fairseq.dataclass import FairseqDataclass

from mlmha_fairseq.errors import UsageError
from mlmha_fairseq.generation.gnmt_length_penalty import GNMTSequenceGenerator


@dataclass
class GNMTLengthPenaltyConfig(FairseqDataclass):
    gnmt_lenpen: Optional[float] = field(
        default=None,
        metadata={"help": "rank finished hypotheses by log P / ((5+|Y|)/6)^ALPHA (GNMT length "
                          "penalty, |Y| counts EOS) instead of fairseq's --lenpen, which is "
                          "then ignored; default: fairseq's behaviour"},
    )


class GNMTLengthPenaltyMixin:
    """Overrides ``build_generator`` to return a :class:`GNMTSequenceGenerator` when the
    task config sets ``gnmt_lenpen``."""

    def build_generator(self, models, args, seq_gen_cls=None, extra_gen_cls_kwargs=None,
                        **kwargs):
        alpha = getattr(self.cfg, "gnmt_lenpen", None)
        if alpha is None or getattr(args, "score_reference", False):
            return super().build_generator(models, args, seq_gen_cls=seq_gen_cls,
                                           extra_gen_cls_kwargs=extra_gen_cls_kwargs, **kwargs)
        if seq_gen_cls is not None or getattr(args, "print_alignment", None):
            raise UsageError("--gnmt-lenpen cannot be combined with --print-alignment or "
                             "another sequence generator class: drop one of them")
        extra = dict(extra_gen_cls_kwargs or {}, gnmt_alpha=alpha)
        return super().build_generator(models, args, seq_gen_cls=GNMTSequenceGenerator,
                                       extra_gen_cls_kwargs=extra, **kwargs)
