"""Decoding multi-source models outside fairseq-generate: on input lines (``fairseq-interactive``
and the hub interface of ``MultiSourceTransformerModel.from_pretrained``), a line of
tab-separated sources, or of text and a row of image features, decodes as fairseq-generate
decodes that tuple of the test set, and a bad line ends with one line naming the expected
sources; in validation (``--eval-bleu``), the BLEU that selects checkpoints is sacreBLEU's on
fairseq-generate's hypotheses of the validation set."""
import json
import re

import numpy as np
import pytest
import sacrebleu
import torch
from fairseq import hub_utils

from fairseq_helpers import (
    USER_DIR,
    generate,
    hypotheses_and_references,
    run_fairseq,
    toy_dictionary,
    train_args,
)
from test_bad_input import one_line_error
from test_multi_source import CHANNELS, POSITIONS, n_way_bin, setup_task, task_options  # noqa: F401 (fixture)
from mlmha_fairseq.data.multi_source_dataset import DataError, PackedSources, derangement
from mlmha_fairseq.errors import UsageError
from mlmha_fairseq.models.multi_source import MultiSourceTransformerModel

TEXT_SOURCES = task_options("s1,s2")
IMAGE_SOURCES = task_options("s1,img", "--image-sources", "img")
# Enough updates for hypotheses that differ from sentence to sentence and depend on every source.
UPDATES = 40
# fairseq-generate's decoding (tests/fairseq_helpers.generate) one sentence at a time, as
# fairseq-interactive and the hub interface below decode: batches of other compositions pad
# differently, which may change a near tie of the beam in the last bits.
ONE_AT_A_TIME = ["--batch-size", "1", "--required-batch-size-multiple", "1"]
DECODING = dict(beam=2, max_len_a=1, max_len_b=5)
SEED = 1  # of --adversarial-seed's derangement


def train(data, save_dir, *options):
    run_fairseq("train", *train_args(data, save_dir, "multi_source_transformer", *options, max_update=UPDATES))
    return save_dir / "checkpoint_last.pt"


@pytest.fixture(scope="module")
def text_model(n_way_bin, tmp_path_factory):
    return train(n_way_bin, tmp_path_factory.mktemp("text_model"), *TEXT_SOURCES)


@pytest.fixture(scope="module")
def image_model(n_way_bin, tmp_path_factory):
    return train(n_way_bin, tmp_path_factory.mktemp("image_model"), *IMAGE_SOURCES)


def split_sentences(data, side):
    """The test split's sentences of ``side``, from the text that was binarized."""
    return (data.parent / "text" / f"test.{side}").read_text().splitlines()


def generated(data, checkpoint, *options):
    hypotheses, _ = hypotheses_and_references(generate(data, checkpoint, *ONE_AT_A_TIME, *options))
    return hypotheses


def interactive(data, checkpoint, lines, *options, check=True):
    return run_fairseq("interactive", data, "--user-dir", USER_DIR, "--path", checkpoint, "--cpu",
                       "--beam", DECODING["beam"], "--max-len-a", DECODING["max_len_a"],
                       "--max-len-b", DECODING["max_len_b"], *options,
                       input="".join(line + "\n" for line in lines), check=check)


def interactive_hypotheses(data, checkpoint, lines, *options):
    hypotheses, _ = hypotheses_and_references(interactive(data, checkpoint, lines, *options).stdout)
    assert len(hypotheses) == len(lines)
    return hypotheses


def tab_separated(*columns):
    return ["\t".join(map(str, fields)) for fields in zip(*columns)]


def test_interactive_decodes_each_line_as_generate_decodes_its_tuple(n_way_bin, text_model):
    """Every field is read as its source: lines whose s2 is another sentence's, by the
    derangement of --adversarial-source s2, decode as generate decodes that split. The
    primary source is the second field, so the packed row does not keep the line's order."""
    s1, s2 = split_sentences(n_way_bin, "s1"), split_sentences(n_way_bin, "s2")
    permutation = derangement(len(s2), SEED)
    lines = tab_separated(s1, s2) + tab_separated(s1, [s2[i] for i in permutation])
    options = [*TEXT_SOURCES, "--primary-source", "s2"]
    got = interactive_hypotheses(n_way_bin, text_model, lines, *options)
    clean = generated(n_way_bin, text_model, *options)
    adversarial = generated(n_way_bin, text_model, *options, "--adversarial-source", "s2",
                            "--adversarial-seed", SEED)
    assert got == clean + adversarial
    assert len(set(clean)) > 1 and clean != adversarial  # the comparison is not vacuous


def test_hub_interface_translates_lines_as_generate(n_way_bin, text_model):
    lines = tab_separated(split_sentences(n_way_bin, "s1"), split_sentences(n_way_bin, "s2"))
    expected = generated(n_way_bin, text_model, *TEXT_SOURCES)
    hub = MultiSourceTransformerModel.from_pretrained(str(text_model.parent), text_model.name,
                                                      str(n_way_bin), batch_size=1)
    assert hub.translate(lines, **DECODING) == expected
    assert hub.translate(lines[3], **DECODING) == expected[3]
    # fairseq's own interface binarizes the whole line as one sentence: refused, not misread
    plain = hub_utils.GeneratorHubInterface(hub.cfg, hub.task, hub.models)
    with pytest.raises(UsageError, match="encode_input_line"):
        plain.translate(lines[3], **DECODING)


def test_image_features_are_the_rows_the_lines_name(n_way_bin, image_model):
    """An image field is a row of --inference-image-features: rows in order decode as the test
    split, rows permuted as the split with its images deranged; the hub interface too."""
    s1, features = split_sentences(n_way_bin, "s1"), n_way_bin / "test.img.npy"
    permutation = derangement(len(s1), SEED)
    lines = tab_separated(s1, range(len(s1))) + tab_separated(s1, permutation)
    options = [*IMAGE_SOURCES, "--inference-image-features", features]
    got = interactive_hypotheses(n_way_bin, image_model, lines, *options)
    clean = generated(n_way_bin, image_model, *IMAGE_SOURCES)
    adversarial = generated(n_way_bin, image_model, *IMAGE_SOURCES, "--adversarial-source", "img",
                            "--adversarial-seed", SEED)
    assert got == clean + adversarial
    assert len(set(clean)) > 1 and clean != adversarial
    hub = MultiSourceTransformerModel.from_pretrained(str(image_model.parent), image_model.name, str(n_way_bin),
                                                      batch_size=1, inference_image_features=str(features))
    assert hub.translate(lines[len(s1):], **DECODING) == adversarial


@pytest.mark.parametrize("line, with_features, message", [
    ("w1 w2", True, "the input line 'w1 w2' has 1 tab-separated field(s); --source-langs s1,img needs "
                    "one per source: s1<TAB>img"),
    ("w1 w2\t16", True, "image source img: '16' in the input line 'w1 w2\\t16' is not a row of"),
    ("w1 w2\tfirst", True, "'first' in the input line"),
    ("w1 w2\t7", False, "the image source(s) img of input lines need --inference-image-features"),
    ("w1 w2\t\u00b2", True, "'\u00b2' in the input line"),  # a digit to str.isdigit, not to int()
    ("\t7", True, "an empty first or last field is lost"),
])
def test_a_bad_line_ends_interactive_with_one_line(n_way_bin, image_model, line, with_features, message):
    features = ["--inference-image-features", n_way_bin / "test.img.npy"] if with_features else []
    lines = ["w3 w4\t2", line] if with_features else [line]  # without features no line is good
    result = interactive(n_way_bin, image_model, lines, *IMAGE_SOURCES, *features, check=False)
    assert message in one_line_error(result)
    assert result.stdout.count("\nH-") == len(lines) - 1  # the lines before it were translated


def test_constraints_are_refused(n_way_bin, image_model):
    """fairseq-interactive would take a line's second field for a constraint."""
    result = interactive(n_way_bin, image_model, ["w1 w2\t3"], *IMAGE_SOURCES, "--constraints", check=False)
    assert "--constraints: the multi_source_translation task decodes without" in one_line_error(result)


def test_inference_features_must_fit_the_image_sources(n_way_bin, tmp_path):
    with pytest.raises(UsageError, match="names 2 file.* for the 1 image source"):
        setup_task(n_way_bin, "s1,img", "--image-sources", "img", "--inference-image-features", "a.npy,b.npy")
    other = tmp_path / "other.npy"
    np.save(other, np.zeros((2, POSITIONS, CHANNELS + 1), dtype=np.float32))
    with pytest.raises(DataError, match="image source img: files with different channels"):
        setup_task(n_way_bin, "s1,img", "--image-sources", "img", "--inference-image-features", str(other))


def test_packed_row_holds_the_primary_source_first_and_unpacks_to_every_source():
    dictionary = toy_dictionary()
    eos, image = dictionary.eos(), len(dictionary)
    packing = PackedSources(["text", "image", "text"], primary_index=2, dictionary=dictionary)
    a, b = torch.tensor([5, 6, eos]), torch.tensor([7, eos])
    row = packing.pack([a, 11, b])
    assert row.tolist() == [7, eos, 5, 6, eos, image + 11]
    assert dictionary.string(row) == "w3 w1 w2 <unk>"  # what fairseq-interactive prints as S-
    unpacked = packing.unpack(row)
    assert torch.equal(unpacked[0], a) and unpacked[1] == 11 and torch.equal(unpacked[2], b)
    for bad in (torch.tensor([5, 6, eos]), torch.tensor([7, eos, 5, eos]), torch.cat([row, row[:2]])):
        with pytest.raises(UsageError, match="not one of the task's packed input lines"):
            packing.unpack(bad)


def test_validation_bleu_selects_the_checkpoint_with_the_bleu_of_its_hypotheses(n_way_bin, tmp_path):
    """fairseq-train --eval-bleu logs, after every epoch, the BLEU of the model's hypotheses
    of the validation set, and --best-checkpoint-metric bleu keeps the best: each equals
    sacreBLEU computed here on fairseq-generate's hypotheses of checkpoint_last.pt and
    checkpoint_best.pt against the validation text. A learning rate at which the last BLEU
    is not the best, so that a checkpoint chosen by the loss would fail."""
    bleu_args = ["--eval-bleu", "--eval-bleu-args", json.dumps(DECODING), "--best-checkpoint-metric", "bleu",
                 "--maximize-best-checkpoint-metric", "--batch-size-valid", "1", "--required-batch-size-multiple", "1"]
    result = run_fairseq("train", *train_args(n_way_bin, tmp_path, "multi_source_transformer", *TEXT_SOURCES,
                                              *bleu_args, "--lr", "0.005", max_update=100))
    logged = [float(value) for value in re.findall(r"valid on 'valid' subset \|.* \| bleu ([\d.]+) \|",
                                                   result.stdout + result.stderr)]
    assert len(logged) > 1 and max(logged) > logged[-1] > 0
    references = (n_way_bin.parent / "text" / "valid.tgt").read_text().splitlines()
    for checkpoint, expected in (("checkpoint_last.pt", logged[-1]), ("checkpoint_best.pt", max(logged))):
        hypotheses = generated(n_way_bin, tmp_path / checkpoint, *TEXT_SOURCES, "--gen-subset", "valid")
        assert round(sacrebleu.corpus_bleu(hypotheses, [references]).score, 2) == expected, checkpoint
