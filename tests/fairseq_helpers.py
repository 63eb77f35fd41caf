"""Shared test helpers: a tiny synthetic corpus, fairseq command-line runs, and models
built in Python from fairseq's own argument parser."""
import importlib.util
import json
import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import sacrebleu
import torch
from fairseq import options, tasks
from fairseq.data import Dictionary
from fairseq.sequence_generator import SequenceGenerator

import fairseq_launcher
import mlmha_fairseq

USER_DIR = os.path.dirname(mlmha_fairseq.__file__)
_SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "reversal_corpus.py"
reversal_corpus = importlib.util.module_from_spec(importlib.util.spec_from_file_location("reversal_corpus", _SCRIPT))
reversal_corpus.__spec__.loader.exec_module(reversal_corpus)
VOCAB = [f"w{i}" for i in range(24)]

PRE_NORM = ["--encoder-normalize-before", "--decoder-normalize-before"]
NORMS = pytest.mark.parametrize("norm", [[], PRE_NORM], ids=["post-norm", "pre-norm"])

# A model small enough to train a few updates on a CPU in about a second.
TINY_MODEL_ARGS = [
    "--encoder-layers", "3", "--decoder-layers", "2",
    "--encoder-embed-dim", "16", "--decoder-embed-dim", "16",
    "--encoder-ffn-embed-dim", "32", "--decoder-ffn-embed-dim", "32",
    "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
]


def write_reversal_corpus(directory: Path, sizes=(("train", 300), ("valid", 16), ("test", 16)), seed=0):
    """A toy translation task (target = source reversed, 3-9 words of VOCAB) in plain text
    files: ``scripts/reversal_corpus.py``, which the Enc-DC shape study also uses."""
    reversal_corpus.write(str(directory), sizes, len(VOCAB), 3, 9, seed)


def run_fairseq(tool: str, *args, check=True, cwd=None, input=None, env=None, module=None, python=None):
    """Run ``fairseq-<tool>`` (as ``python -m fairseq_cli.<tool>``, or ``module`` that stands
    in for it; ``python``: the interpreter's command, default this one, whose runs
    :mod:`fairseq_launcher` forks) and return the result.

    One intra-op thread: tiny models gain nothing from more, and test processes share cores.

    A process that aborts at interpreter exit with C++'s "terminate called without an active
    exception" (SIGABRT; seen in module fixtures' fairseq-train during clean-clone runs of the
    suite, after the training's last log line; cause not found) is run once more, so that this
    teardown crash does not fail a whole test module; a second abort fails as any error. A
    training that logged "done training" before the abort has written its checkpoints and is
    not rerun: the rerun would resume from them and train past --max-update."""
    for _attempt in range(2):
        command, env = [module or f"fairseq_cli.{tool}", *map(str, args)], {"OMP_NUM_THREADS": "1", **(env or os.environ)}
        if python is None:  # this interpreter: forked from one that has imported torch and fairseq
            result = fairseq_launcher.run_module(command[0], command[1:], env=env, cwd=cwd, input=input)
        else:
            result = subprocess.run([*python, "-m", *command], capture_output=True, text=True, cwd=cwd,
                                    input=input, env=env)
        if not (result.returncode == -signal.SIGABRT
                and result.stderr.rstrip().endswith("terminate called without an active exception")):
            break
        if tool == "train" and "done training in" in result.stdout + result.stderr:
            result = subprocess.CompletedProcess(result.args, 0, result.stdout, result.stderr)
            break
    if check and result.returncode != 0:
        raise AssertionError(f"fairseq-{tool} failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return result


N_WAY_SPLITS = (("train", 200), ("valid", 16), ("test", 16))


def write_n_way_text(directory: Path, seed=0):
    """The reversal task with two sources: s1 (words of VOCAB), s2 (the same words upper-cased,
    a second vocabulary); target tgt = the words reversed."""
    rng = random.Random(seed)
    for split, n in N_WAY_SPLITS:
        sentences = [[rng.choice(VOCAB) for _ in range(rng.randint(3, 8))] for _ in range(n)]
        sides = {"s1": sentences, "s2": [[w.upper() for w in s] for s in sentences],
                 "tgt": [list(reversed(s)) for s in sentences]}
        for side, lines in sides.items():
            (directory / f"{split}.{side}").write_text("".join(" ".join(line) + "\n" for line in lines))


def binarize_n_way(text: Path, destdir: Path):
    """One joint dictionary over all training text, then one fairseq-preprocess run per
    (source, target) pair with --srcdict/--tgtdict (as the corpus builder does)."""
    dictionary = Dictionary()
    for side in ("s1", "s2", "tgt"):
        for line in (text / f"train.{side}").read_text().splitlines():
            for word in line.split():
                dictionary.add_symbol(word)
    destdir.mkdir(exist_ok=True)
    dictionary.save(str(destdir / "dict.txt"))
    for source in ("s1", "s2"):
        run_fairseq(
            "preprocess", "--source-lang", source, "--target-lang", "tgt",
            "--trainpref", text / "train", "--validpref", text / "valid", "--testpref", text / "test",
            "--destdir", destdir, "--srcdict", destdir / "dict.txt", "--tgtdict", destdir / "dict.txt",
            "--workers", "1",
        )


def preprocess(corpus: Path, destdir: Path):
    run_fairseq(
        "preprocess", "--source-lang", "src", "--target-lang", "tgt",
        "--trainpref", corpus / "train", "--validpref", corpus / "valid",
        "--testpref", corpus / "test", "--destdir", destdir,
        "--joined-dictionary", "--workers", "1",
    )


def train_args(data_bin: Path, save_dir: Path, arch: str, *extra, max_update=3):
    return [
        data_bin, "--user-dir", USER_DIR, "--arch", arch, *TINY_MODEL_ARGS,
        "--optimizer", "adam", "--lr", "0.001", "--max-tokens", "400",
        "--max-update", max_update, "--cpu", "--save-dir", save_dir,
        "--no-progress-bar", "--log-interval", "1", "--seed", "1",
        "--num-workers", "0", *extra,
    ]


def generate(data_bin, checkpoint, *extra):
    """fairseq-generate's stdout for the test split."""
    return run_fairseq(
        "generate", data_bin, "--user-dir", USER_DIR, "--path", checkpoint,
        "--beam", "2", "--cpu", "--max-len-a", "1", "--max-len-b", "5", *extra,
    ).stdout


def hypotheses_and_references(generate_output):
    """D- and T- lines of fairseq-generate, in sentence order."""
    lines = {}
    for kind in ("D", "T"):
        rows = re.findall(rf"^{kind}-(\d+)\t(?:[^\t]*\t)?(.*)$", generate_output, flags=re.M)
        lines[kind] = [text for _, text in sorted(rows, key=lambda row: int(row[0]))]
    return lines["D"], lines["T"]


def assert_round_trip(data_bin, save_dir, arch, *extra, generate_options=()):
    """fairseq-train (a few updates) -> checkpoint -> fairseq-generate -> sacreBLEU."""
    run_fairseq("train", *train_args(data_bin, save_dir, arch, *extra))
    checkpoint = save_dir / "checkpoint_last.pt"
    assert checkpoint.exists()
    hyps, refs = hypotheses_and_references(generate(data_bin, checkpoint, *generate_options))
    assert len(hyps) == len(refs) == 16
    assert 0.0 <= sacrebleu.corpus_bleu(hyps, [refs]).score <= 100.0


def toy_dictionary(words=VOCAB) -> Dictionary:
    dictionary = Dictionary()
    for word in words:
        dictionary.add_symbol(word)
    return dictionary


def build_model(arch: str, *extra, dictionary=None):
    """A model built exactly as fairseq-train builds it, on a toy joint dictionary."""
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(
        parser,
        ["unused-data-dir", "--task", "translation", "--user-dir", USER_DIR,
         "--arch", arch, *TINY_MODEL_ARGS, *map(str, extra)],
    )
    dictionary = dictionary or toy_dictionary()
    task = tasks.translation.TranslationTask(args, dictionary, dictionary)
    return task.build_model(args)


def random_batch(dictionary: Dictionary, batch_size=4, src_len=7, tgt_len=6, left_pad=True, seed=0):
    """Source tokens with varied lengths (padded on the left like fairseq's default) and
    teacher-forcing decoder inputs."""
    gen = torch.Generator().manual_seed(seed)
    low, high = dictionary.nspecial, len(dictionary)
    src = torch.randint(low, high, (batch_size, src_len), generator=gen)
    lengths = torch.tensor([src_len - (i % 3) for i in range(batch_size)])
    for i, length in enumerate(lengths):
        pad = slice(0, src_len - length) if left_pad else slice(length, src_len)
        src[i, pad] = dictionary.pad()
        src[i, src_len - 1 if left_pad else length - 1] = dictionary.eos()
    prev = torch.randint(low, high, (batch_size, tgt_len), generator=gen)
    prev[:, 0] = dictionary.eos()
    return src, lengths, prev


def full_logits(model, src, lengths, prev):
    encoder_out = model.encoder(src, src_lengths=lengths)
    return model.decoder(prev, encoder_out=encoder_out)[0]


# fairseq's alignment arguments of a decoder's ``extract_features``
ALIGNMENT_OPTIONS = pytest.mark.parametrize(
    "options", [{}, {"alignment_layer": 0, "alignment_heads": 1}, {"full_context_alignment": True}],
    ids=["defaults", "alignment-layer-and-heads", "full-context"])


def assert_features_match_with_alignment_options(reference, decoder, prev, encoder_out, options):
    """``decoder.extract_features(prev, encoder_out, **options)`` equals ``reference``'s (the
    features and the returned attention), and the given arguments change ``reference``'s result,
    so that a decoder ignoring them would fail."""
    with torch.no_grad():
        expected, expected_extra = reference.extract_features(prev, encoder_out, **options)
        got, got_extra = decoder.extract_features(prev, encoder_out, **options)
        default, default_extra = reference.extract_features(prev, encoder_out)
    assert torch.equal(got, expected) and torch.equal(got_extra["attn"][0], expected_extra["attn"][0])
    if options:
        assert not (torch.equal(expected, default) and torch.equal(expected_extra["attn"][0], default_extra["attn"][0]))


def assert_incremental_matches_full(model, dictionary, new_order=(2, 0, 0, 3, 1), reorder_step=2, atol=1e-5, rtol=1e-5):
    """Step-by-step decoding with fairseq's incremental state equals the teacher-forced
    forward pass, also after a beam-search-like reordering of the batch (rows repeated,
    dropped and permuted) in the middle of decoding, as SequenceGenerator does."""
    model.eval()
    device = next(model.parameters()).device
    src, lengths, prev = (t.to(device) for t in random_batch(dictionary, batch_size=4))
    new_order = torch.tensor(new_order, device=device)
    with torch.no_grad():
        before = full_logits(model, src, lengths, prev)
        after = full_logits(model, src[new_order], lengths[new_order], prev[new_order])
        encoder_out = model.encoder(src, src_lengths=lengths)
        state, rows = {}, prev
        for step in range(prev.size(1)):
            if step == reorder_step:
                encoder_out = model.encoder.reorder_encoder_out(encoder_out, new_order)
                model.decoder.reorder_incremental_state_scripting(state, new_order)
                rows = prev[new_order]
            out = model.decoder(rows[:, : step + 1], encoder_out=encoder_out, incremental_state=state)[0]
            expected = (after if step >= reorder_step else before)[:, step : step + 1]
            torch.testing.assert_close(out, expected, atol=atol, rtol=rtol, msg=f"step {step}")


def assert_beam_search_scores_match_full(model, dictionary, monkeypatch, beam_size=3):
    """fairseq's beam search, with its real reorders (hypotheses moving among the beams
    of a sentence, and finished sentences leaving the batch): every token score of every
    hypothesis equals the log-probability of that token in a full forward pass on the
    hypothesis alone, so a cache that follows the wrong hypothesis fails."""
    model.eval()
    src, lengths, _ = random_batch(dictionary, batch_size=8)
    sizes = []
    reorder = model.decoder.reorder_incremental_state_scripting
    monkeypatch.setattr(
        model.decoder, "reorder_incremental_state_scripting",
        lambda state, new_order: sizes.append(new_order.numel()) or reorder(state, new_order),
    )
    # An untrained model ends all its sentences at once or never: a shifted EOS logit (in the
    # generator and in the reference alike) makes them finish at different steps.
    output_layer, eos_bonus = model.decoder.output_layer, torch.zeros(len(dictionary))
    monkeypatch.setattr(model.decoder, "output_layer", lambda features: output_layer(features) + eos_bonus)
    generator = SequenceGenerator([model], dictionary, beam_size=beam_size, max_len_b=10)
    with torch.no_grad():
        for bonus in torch.arange(-3.0, 4.0, 0.25).tolist():
            eos_bonus[dictionary.eos()], sizes[:] = bonus, []
            hypotheses = generator.generate([model], {"net_input": {"src_tokens": src, "src_lengths": lengths}})
            same_size = any(a == b for a, b in zip(sizes, sizes[1:]))
            if same_size and len(set(sizes)) > 1:
                break
        else:
            raise AssertionError("no EOS bonus made sentences finish at different steps")
        for row, sentence in enumerate(hypotheses):
            keep = src[row] != dictionary.pad()
            for hypothesis in sentence:
                tokens = hypothesis["tokens"]
                prev = torch.cat([tokens.new_tensor([dictionary.eos()]), tokens[:-1]])
                logits = model(src[row][keep][None], lengths[row : row + 1], prev[None])[0]
                lprobs = model.get_normalized_probs((logits, None), log_probs=True)[0]
                expected = lprobs.gather(-1, tokens[:, None]).squeeze(-1)
                torch.testing.assert_close(hypothesis["positional_scores"], expected, atol=1e-4, rtol=0)


def results_rows(work):
    """The experiment runner's results.json rows: every score of every seed, s_sel, the p-values and the parameter
    counts; the training time and speed, which no two runs share, are checked to be measured."""
    rows = json.loads((work / "results.json").read_text())["systems"]
    for row in rows:
        costs = row["costs"]
        assert all(value > 0 for value in costs.pop("train time (s)") + costs.pop("tokens/s"))
        assert all(count > 0 for count in costs["params"])
    return rows


# The experiment runner's tests (a line of their grids): their untrained models never end a
# sentence, so fairseq-generate would run each test sentence to the runner's length limit
# (1.2 x its length + 10; 250 steps for the tiny corpus's long verse): a short fixed limit
# checks the same at a fraction of the decoding time.
DECODING = 'generate_args = ["--max-len-a", "0", "--max-len-b", "20"]'
