"""One rank of a data-parallel fairseq-train run, for tests/test_distributed.py.

Runs fairseq-train unchanged, except that every rank writes its model parameters to
``$DDP_DUMP_DIR/rank<r>.pt`` when fairseq saves a checkpoint (fairseq itself only writes
checkpoints on rank 0)."""
import os
import sys

import torch
from fairseq import checkpoint_utils
from fairseq_cli import train

save_checkpoint = checkpoint_utils.save_checkpoint


def save_checkpoint_and_dump_rank(cfg, trainer, epoch_itr, val_loss):
    path = os.path.join(os.environ["DDP_DUMP_DIR"], f"rank{trainer.data_parallel_rank}.pt")
    state = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    torch.save({"params": state, "num_updates": trainer.get_num_updates()}, path)
    return save_checkpoint(cfg, trainer, epoch_itr, val_loss)


if __name__ == "__main__":
    checkpoint_utils.save_checkpoint = save_checkpoint_and_dump_rank
    sys.argv[0] = "fairseq-train"
    train.cli_main()
