"""fairseq-train, with ``--bf16`` on a GPU or CPU and ``torchrun`` on CPUs.

fairseq-train's own options and ``main``, parsed by fairseq's parser, with two settings
that fairseq's command line gets wrong:

* fairseq turns ``--bf16`` into ``--tpu`` (``fairseq/options.py``), so ``fairseq-train
  --bf16`` fails on a GPU or CPU machine without torch_xla; here ``--tpu`` stays as given.
* under ``torchrun``, fairseq reads the rank from the environment only with an explicit
  ``--distributed-world-size`` and then divides by the number of GPUs (ZeroDivisionError on
  CPUs); here a process started by torchrun takes its rank, world size and local device
  from torchrun's environment, on GPUs and CPUs alike.

Examples::

    python -m mlmha_fairseq.cli.train data-bin --user-dir mlmha_fairseq --arch mlmha_transformer_iwslt --bf16 ...
    torchrun --nproc_per_node 2 -m mlmha_fairseq.cli.train data-bin --user-dir mlmha_fairseq ... \
        --cpu --distributed-backend gloo
"""
import os
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
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and args.distributed_init_method is None:
        # started by torchrun: one process per rank, already started
        args.distributed_init_method = "env://"
        args.distributed_world_size = int(os.environ["WORLD_SIZE"])
        args.distributed_rank = int(os.environ["RANK"])
        args.device_id = int(os.environ.get("LOCAL_RANK", 0))
        args.distributed_no_spawn = True
    distributed_utils.call_main(convert_namespace_to_omegaconf(args), train.main)


if __name__ == "__main__":
    main()
