"""One rank of a data-parallel fairseq-train run (or a single-process run), for
tests/test_distributed.py; torchrun can start it as it starts fairseq-train.

Runs fairseq-train (through ``mlmha_fairseq.cli.train``, which reads torchrun's environment
on CPUs too) unchanged, except that every rank writes its model parameters to
``$DDP_DUMP_DIR/rank<r>.pt``: once after the model is loaded (``initial``) and again when
fairseq saves a checkpoint (fairseq itself only writes checkpoints on rank 0)."""
import os
import sys

import torch
from fairseq import checkpoint_utils

from mlmha_fairseq.cli import train

save_checkpoint = checkpoint_utils.save_checkpoint
load_checkpoint = checkpoint_utils.load_checkpoint
initial = {}


def parameters(trainer):
    return {name: p.detach().float().clone() for name, p in trainer.get_model().named_parameters()}


def load_checkpoint_and_keep_initial(cfg, trainer, **kwargs):
    result = load_checkpoint(cfg, trainer, **kwargs)
    initial.update(parameters(trainer))
    return result


def save_checkpoint_and_dump_rank(cfg, trainer, epoch_itr, val_loss):
    path = os.path.join(os.environ["DDP_DUMP_DIR"], f"rank{trainer.data_parallel_rank}.pt")
    torch.save({"params": parameters(trainer), "initial": initial, "num_updates": trainer.get_num_updates()}, path)
    return save_checkpoint(cfg, trainer, epoch_itr, val_loss)


# at import, so that processes fairseq spawns (which import this file again) dump too
checkpoint_utils.load_checkpoint = load_checkpoint_and_keep_initial
checkpoint_utils.save_checkpoint = save_checkpoint_and_dump_rank

if __name__ == "__main__":
    sys.argv[0] = "fairseq-train"
    train.main()
