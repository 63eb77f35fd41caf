"""fairseq-train, with ``--bf16`` on a GPU or CPU, and ``torchrun`` or ``srun`` on CPUs.

fairseq-train's own options and ``main``, parsed by fairseq's parser, with two settings
that fairseq's command line gets wrong:

* fairseq turns ``--bf16`` into ``--tpu`` (``fairseq/options.py``), so ``fairseq-train
  --bf16`` fails on a GPU or CPU machine without torch_xla; here ``--tpu`` stays as given.
* under ``torchrun``, fairseq reads the rank from the environment only with an explicit
  ``--distributed-world-size`` and then divides by the number of GPUs (ZeroDivisionError on
  CPUs); here a process started by torchrun takes its rank, world size and local device
  from torchrun's environment, on GPUs and CPUs alike.
* under ``srun`` with ``--distributed-world-size`` and ``--distributed-port``, fairseq's own
  Slurm initialisation serves GPUs, but on CPUs it calls ``torch.cuda.set_device`` with the
  task's ``SLURM_LOCALID`` (fairseq/distributed/utils.py, ``infer_init_method``), which fails
  for every task but the first of a node; here a ``--cpu`` task takes the same rendezvous
  (the job's first node, ``--distributed-port``) and its rank from ``SLURM_PROCID`` itself.

It runs from any directory with either ``--user-dir`` form (``mlmha_fairseq`` or the
package's folder): see :func:`user_dir_of_this_package`.

Examples::

    python -m mlmha_fairseq.cli.train data-bin --user-dir mlmha_fairseq --arch mlmha_transformer_iwslt --bf16 ...
    torchrun --nproc_per_node 2 -m mlmha_fairseq.cli.train data-bin --user-dir mlmha_fairseq ... \
        --cpu --distributed-backend gloo
    srun --ntasks 2 python -m mlmha_fairseq.cli.train data-bin --user-dir mlmha_fairseq ... \
        --cpu --distributed-backend gloo --distributed-world-size 2 --distributed-port 12345
"""
import os
import subprocess
import sys
from typing import List

from fairseq import options
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.distributed import utils as distributed_utils
from fairseq_cli import train

import mlmha_fairseq
from mlmha_fairseq.child_processes import end_with_parent
from mlmha_fairseq.cli import _support as cli_support
from mlmha_fairseq.errors import UsageError

USER_DIR_FLAG = "--user-dir"


def user_dir_of_this_package(argv: List[str]) -> List[str]:
    """``argv`` with a ``--user-dir`` that names this package replaced by the folder the
    running package was imported from.

    This module is itself part of ``mlmha_fairseq``, so the package is imported before fairseq
    reads ``--user-dir``; fairseq then accepts a folder named ``mlmha_fairseq`` only when its
    path is, as a string, one of the imported package's ``__path__`` (otherwise: "module name
    (mlmha_fairseq) is not globally unique"). Which path that is depends on the current
    directory: the repository's folder from the repository root, else the link next to
    fairseq that ``link_user_dir`` makes. Another copy of the package is refused, since its
    code would not be the code that runs. A ``--user-dir`` of another name is left alone."""
    package = os.path.realpath(mlmha_fairseq.__path__[0])
    result = list(argv)
    for index, arg in enumerate(argv):
        if arg == USER_DIR_FLAG and index + 1 < len(argv):
            position, given, prefix = index + 1, argv[index + 1], ""
        elif arg.startswith(USER_DIR_FLAG + "="):
            position, given, prefix = index, arg[len(USER_DIR_FLAG) + 1:], USER_DIR_FLAG + "="
        else:
            continue
        if os.path.basename(os.path.normpath(given)) != mlmha_fairseq.__name__:
            continue
        if os.path.isdir(given) and os.path.realpath(given) != package:
            raise UsageError(f"--user-dir {given} is another copy of {mlmha_fairseq.__name__} than the one "
                             f"running this command ({package}): pass --user-dir {package}, or run "
                             "python -m mlmha_fairseq.cli.train with the Python environment of that copy")
        result[position] = prefix + mlmha_fairseq.__path__[0]
    return result


def main(argv=None):
    if argv is None:
        # fairseq's get_parser imports --user-dir as sys.argv gives it, whatever it parses later
        sys.argv[1:] = user_dir_of_this_package(sys.argv[1:])
        argv = sys.argv[1:]
    else:
        argv = user_dir_of_this_package(argv)
    parser = options.get_training_parser()
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
    elif args.cpu and args.distributed_world_size > 1 and args.distributed_port > 0 \
            and args.distributed_init_method is None and "SLURM_PROCID" in os.environ:
        slurm_cpu_rank(args)
    distributed_utils.call_main(convert_namespace_to_omegaconf(args), train.main)


def slurm_cpu_rank(args) -> None:
    """This ``srun`` task's place in a CPU data-parallel run: the rendezvous and the rank that
    fairseq's Slurm initialisation derives for GPUs, from the same variables."""
    tasks = int(os.environ.get("SLURM_STEP_NUM_TASKS") or os.environ.get("SLURM_NTASKS") or 0)
    if tasks != args.distributed_world_size:
        raise UsageError(f"--distributed-world-size {args.distributed_world_size} does not match this Slurm step's "
                         f"{tasks} task(s): start one task per rank (srun --ntasks {args.distributed_world_size})")
    nodes = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST")
    if not nodes:
        raise UsageError("a --cpu run under srun needs SLURM_STEP_NODELIST or SLURM_JOB_NODELIST to find its "
                         "first node")
    try:
        first = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True, text=True,
                               check=True, preexec_fn=end_with_parent).stdout.split()[0]
    except (OSError, subprocess.CalledProcessError, IndexError) as error:
        raise UsageError(f"scontrol show hostnames {nodes} failed ({error}): a --cpu run under srun needs Slurm's "
                         "scontrol to find its first node") from None
    args.distributed_init_method = f"tcp://{first}:{args.distributed_port}"
    args.distributed_rank = int(os.environ["SLURM_PROCID"])
    args.distributed_no_spawn = True


if __name__ == "__main__":
    cli_support.command(main)
