"""fairseq's ``translation`` task with the GNMT length penalty (``--gnmt-lenpen ALPHA``).

Decode as the documents did (beam, GNMT alpha, max length ``src_len + 20``)::

    fairseq-generate data-bin --user-dir mlmha_fairseq --task translation_gnmt \
        --path checkpoint.pt --beam 4 --gnmt-lenpen 0.6 --max-len-a 1 --max-len-b 20
"""
from dataclasses import dataclass

from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask

from mlmha_fairseq.generation.gnmt_task_mixin import (
    GNMTLengthPenaltyConfig,
    GNMTLengthPenaltyMixin,
)


@dataclass
class TranslationGNMTConfig(TranslationConfig, GNMTLengthPenaltyConfig):
    """TranslationConfig plus ``gnmt_lenpen``."""


@register_task("translation_gnmt", dataclass=TranslationGNMTConfig)
class TranslationGNMTTask(GNMTLengthPenaltyMixin, TranslationTask):
    """Translation with an optional GNMT length penalty at generation time."""
