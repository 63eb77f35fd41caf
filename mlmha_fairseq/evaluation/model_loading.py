"""Loading a fairseq checkpoint and turning source sentences into encoder batches
(shared by the attention statistics and the probing features)."""
import contextlib
import math
import os
import pickle
import random
from typing import Any, Iterable, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch

from mlmha_fairseq.compat import UnsafeCheckpointError, check_stored_options
from mlmha_fairseq.errors import unsafe_checkpoint_message
from mlmha_fairseq.evaluation.text_io import InputError, read_lines

DEFAULT_BATCH_SIZE = 32


@contextlib.contextmanager
def checkpoint_errors(path: str):
    """Turn torch's errors for a file that is not a loadable checkpoint (empty, truncated,
    not a torch file, holding objects safe loading refuses, or options that are code) into one
    :class:`InputError` naming ``path``."""
    try:
        yield
    except UnsafeCheckpointError as error:
        raise InputError(f"{path}: {error}") from None
    except EOFError as error:
        raise InputError(f"checkpoint {path} is empty or truncated") from error
    except pickle.UnpicklingError as error:
        message = unsafe_checkpoint_message(error) or " ".join(str(error).split())
        raise InputError(f"checkpoint {path}: {message}") from None
    except RuntimeError as error:
        if "PytorchStreamReader" not in str(error):
            raise
        raise InputError(f"checkpoint {path} is truncated or corrupt ({str(error).split('.')[0]})") from error


def load_model(checkpoint: str, data_bin: Optional[str] = None):
    """The first model of ``checkpoint`` (eval mode, CPU) and its task (see
    :func:`load_model_and_state`)."""
    model, task, _state = load_model_and_state(checkpoint, data_bin)
    return model, task


def trained_updates(state) -> int:
    """The number of updates a checkpoint's model was trained for (0 for a model saved
    without optimizer history)."""
    return int((state.get("optimizer_history") or [{}])[-1].get("num_updates", 0))


def load_model_and_state(checkpoint: str, data_bin: Optional[str] = None):
    """The first model of ``checkpoint`` (eval mode, CPU), its task and the checkpoint's
    state dict (for its training history).

    ``data_bin`` replaces the data directory stored in the checkpoint, so that the task can
    find its dictionaries. Uses ``fairseq.checkpoint_utils``, which this package makes safe
    on torch >= 2.6 when ``mlmha_fairseq`` is imported; options stored as dicts, which
    unpickling does not check, are checked before anything is built.
    """
    from fairseq import checkpoint_utils

    if not os.path.isfile(checkpoint):
        raise InputError(f"checkpoint not found: {checkpoint}")
    if data_bin is not None and not os.path.isdir(data_bin):
        raise InputError(f"data-bin directory not found: {data_bin}")
    overrides = {"data": data_bin} if data_bin else None
    with checkpoint_errors(checkpoint):
        state = checkpoint_utils.load_checkpoint_to_cpu(checkpoint, overrides)
        check_stored_options(state)
        models, _cfg, task = checkpoint_utils.load_model_ensemble_and_task(
            [checkpoint], arg_overrides=overrides, state=state)
    return models[0].eval(), task, state


def apply_bpe(lines: Sequence[str], codes_path: Optional[str]) -> List[str]:
    """Segment tokenized lines with a subword-nmt codes file (``None``: lines unchanged)."""
    if codes_path is None:
        return list(lines)
    from subword_nmt.apply_bpe import BPE

    with open(codes_path, encoding="utf-8") as codes:
        bpe = BPE(codes)
    return [bpe.process_line(line) for line in lines]


def encode_lines(lines: Sequence[str], dictionary) -> List[torch.Tensor]:
    """Token ids of each line with the source dictionary, EOS appended (as fairseq does)."""
    return [dictionary.encode_line(line, add_if_not_exist=False, append_eos=True).long()
            for line in lines]


def sample_indices(total: int, size: Optional[int], seed: int) -> List[int]:
    """``size`` distinct line indices drawn at random (all lines, in order, if ``size`` is
    ``None`` or not smaller than ``total``), returned sorted."""
    if size is None or size >= total:
        return list(range(total))
    return sorted(random.Random(seed).sample(range(total), size))


def batches(token_lists: Sequence[torch.Tensor], dictionary, batch_size: int = DEFAULT_BATCH_SIZE,
            left_pad: bool = True) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """Padded ``(src_tokens, src_lengths)`` batches in input order (fairseq's collater
    pads the source on the left by default)."""
    from fairseq.data.data_utils import collate_tokens

    for start in range(0, len(token_lists), batch_size):
        chunk = token_lists[start:start + batch_size]
        tokens = collate_tokens(chunk, dictionary.pad(), dictionary.eos(), left_pad=left_pad)
        yield tokens, torch.tensor([t.numel() for t in chunk])


def left_pad_source(task) -> bool:
    """The task's source padding side (fairseq's translation default: left)."""
    return bool(getattr(getattr(task, "cfg", None), "left_pad_source", True))


def source_tokens(args, task, lines):
    """Token tensors of the chosen sentences: ``lines`` encoded, or the binarized split."""
    dictionary = task.source_dictionary
    if lines is not None:
        return encode_lines(lines, dictionary)
    try:
        task.load_dataset(args.split)
    except FileNotFoundError as error:
        raise InputError(f"--split {args.split}: {error}") from error
    source = task.dataset(args.split).src
    return [source[i] for i in sample_indices(len(source), args.sample, args.seed)]


def read_sentences(args):
    """``--input`` lines (sampled, BPE applied), or None with ``--split``."""
    if args.input is None:
        return None
    lines = read_lines(args.input)
    lines = [lines[i] for i in sample_indices(len(lines), args.sample, args.seed)]
    return apply_bpe(lines, args.bpe_codes)


class CheckpointBatches(NamedTuple):
    """One checkpoint of an analysis over several: its name, model, task, the chosen
    sentences' token tensors and their batches (a progress bar over ``(src_tokens,
    src_lengths)``, in the task's padding)."""

    name: str
    model: Any
    task: Any
    tokens: List[torch.Tensor]
    batches: Iterable[Tuple[torch.Tensor, torch.Tensor]]


def checkpoint_batches(names: Sequence[str], args, lines: Optional[List[str]]) -> Iterator[CheckpointBatches]:
    """The loop of the analyses that compare checkpoints on the same sentences: each of
    ``args.checkpoints`` loaded (with ``args.data_bin``), one at a time, and its batches of
    ``lines`` (:func:`read_sentences`) or of ``args.split`` (``args.batch_size`` sentences each)."""
    from tqdm import tqdm

    for name, checkpoint in zip(names, args.checkpoints):
        model, task = load_model(checkpoint, args.data_bin)
        tokens = source_tokens(args, task, lines)
        progress = tqdm(batches(tokens, task.source_dictionary, args.batch_size, left_pad_source(task)),
                        total=math.ceil(len(tokens) / args.batch_size), desc=name)
        yield CheckpointBatches(name, model, task, tokens, progress)
