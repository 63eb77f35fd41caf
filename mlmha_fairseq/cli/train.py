"""fairseq-train, with ``--bf16`` training in bfloat16 on the chosen GPU or CPU.

fairseq's command line turns ``--bf16`` into ``--tpu`` (``fairseq/options.py``), so
``fairseq-train --bf16`` fails on a GPU or CPU machine without torch_xla. This entry point
parses the same options with fairseq's own parser, leaves ``--tpu`` as the user gave it, and
runs fairseq-train's ``main`` (distributed launch included); every other option behaves as
in fairseq-train.

Examples::

    python -m mlmha_fairseq.cli.train data-bin --user-dir mlmha_fairseq --arch mlmha_transformer_iwslt --bf16 ...
    python -m mlmha_fairseq.cli.train data-bin --user-dir mlmha_fairseq ... --cpu --bf16
"""
import sys

from fairseq import options
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.distributed import utils as distributed_utils
from fairseq_cli import train


def main(argv=None):
    parser = options.get_training_parser()
    argv = sys.argv[1:] if argv is None else argv
    args = options.parse_args_and_arch(parser, argv)
    # --bf16 implied --tpu above; keep the user's own --tpu only.
    args.tpu = "--tpu" in argv
    distributed_utils.call_main(convert_namespace_to_omegaconf(args), train.main)


if __name__ == "__main__":
    main()
