import csv
import json
import random

import numpy as np
import pytest
import torch

from fixtures.tiny_fairseq import WORDS, build_task_and_model, save_checkpoint, write_data_bin
from mlmha_fairseq.evaluation.model_loading import batches, encode_lines
from mlmha_fairseq.evaluation.probing import (
    MLP_MAX_EPOCHS,
    MLP_PATIENCE,
    THESIS_MLP_SCHEDULES,
    encoder_features,
    fit_probe,
    mean_pool,
    parse_senteval,
    train_mlp,
)
from mlmha_fairseq.evaluation.text_io import InputError

SPLIT_SIZES = {"tr": 240, "va": 60, "te": 100}
MARKER = "w3"


def synthetic_probing_lines(seed, random_labels):
    """Label = whether the marker token occurs (trivially decodable), or a coin flip."""
    rng = random.Random(seed)
    others = [w for w in WORDS if w != MARKER]
    lines = []
    for split, size in SPLIT_SIZES.items():
        for _ in range(size):
            words = [rng.choice(others) for _ in range(rng.randint(3, 8))]
            has_marker = rng.random() < 0.5
            if has_marker:
                words[rng.randrange(len(words))] = MARKER
            label = rng.choice("AB") if random_labels else ("A" if has_marker else "B")
            lines.append(f"{split}\t{label}\t{' '.join(words)}")
    return lines


def test_parse_senteval():
    data = parse_senteval(["tr\tPRES\tHe walks .", "va\tPAST\tShe ran .", "te\tPAST\tIt fell ."])
    assert data.sentences["tr"] == ["He walks ."] and data.labels["te"] == ["PAST"]
    with pytest.raises(InputError, match=":2:"):
        parse_senteval(["tr\tA\tx", "xx\tA\ty"])
    with pytest.raises(InputError, match="no examples for split"):
        parse_senteval(["tr\tA\tx", "va\tB\ty"])


def test_mean_pool_excludes_padding():
    states = torch.tensor([[[1.0], [7.0]], [[3.0], [2.0]], [[5.0], [4.0]]])  # T=3, B=2, C=1
    padding = torch.tensor([[True, False, False], [False, False, True]])
    pooled = mean_pool(states, padding)
    assert pooled[:, 0].tolist() == pytest.approx([(3.0 + 5.0) / 2, (7.0 + 2.0) / 2])


def test_fit_probe_on_separable_and_random_features():
    rng = np.random.default_rng(0)
    labels = {s: list(rng.choice(["x", "y"], size=n)) for s, n in SPLIT_SIZES.items()}
    separable = {s: rng.normal(size=(len(l), 4)) + 3 * (np.array(l) == "x")[:, None]
                 for s, l in labels.items()}
    assert fit_probe(separable, labels).test_accuracy > 0.95
    noise = {s: rng.normal(size=(len(l), 4)) for s, l in labels.items()}
    assert fit_probe(noise, labels, classifier="mlp").test_accuracy < 0.7


def gaussian_classes(seed, shift):
    """Two classes in 4 dimensions, class 1 shifted by ``shift`` in every coordinate."""
    generator = torch.Generator().manual_seed(seed)
    targets = {s: torch.randint(0, 2, (n,), generator=generator) for s, n in SPLIT_SIZES.items()}
    features = {s: torch.randn(len(t), 4, generator=generator) + shift * t[:, None].float()
                for s, t in targets.items()}
    return features, targets


def dev_accuracy(run, features, targets):
    with torch.no_grad():
        return run.model(features["va"]).argmax(-1).eq(targets["va"]).float().mean().item()


@pytest.mark.parametrize("chapter", sorted(THESIS_MLP_SCHEDULES))
def test_thesis_mlp_learns_and_early_stops(chapter):
    schedule = THESIS_MLP_SCHEDULES[chapter]
    features, targets = gaussian_classes(0, shift=3.0)
    run = train_mlp(features, targets, 2, hidden=50, schedule=schedule)
    assert run.dev_accuracy > 0.95
    # pure noise: dev accuracy stops improving, training ends PATIENCE epochs after the best
    # epoch, and the returned weights are the best epoch's
    noise, noise_targets = gaussian_classes(1, shift=0.0)
    stopped = train_mlp(noise, noise_targets, 2, hidden=50, schedule=schedule)
    assert stopped.epochs_run == stopped.best_epoch + MLP_PATIENCE < MLP_MAX_EPOCHS
    assert dev_accuracy(stopped, noise, noise_targets) == stopped.dev_accuracy
    again = train_mlp(noise, noise_targets, 2, hidden=50, schedule=schedule)
    assert again.epochs_run == stopped.epochs_run
    assert all(torch.equal(a, b) for a, b in zip(again.model.parameters(), stopped.model.parameters()))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    data = write_data_bin(str(tmp_path_factory.mktemp("data-bin")))
    cfg, task, model = build_task_and_model(data, seed=11)
    return data, cfg, task, model


def probe_accuracy(task, model, lines, layer=None):
    data = parse_senteval(lines)
    dictionary = task.source_dictionary
    features = {split: encoder_features(model, batches(encode_lines(data.sentences[split], dictionary),
                                                       dictionary, 64), dictionary.pad(), layer)
                for split in SPLIT_SIZES}
    return fit_probe(features, data.labels).test_accuracy


def test_probe_on_frozen_encoder_decodes_token_but_not_random_labels(tiny):
    _, _, task, model = tiny
    decodable = probe_accuracy(task, model, synthetic_probing_lines(1, random_labels=False))
    random_labels = probe_accuracy(task, model, synthetic_probing_lines(1, random_labels=True))
    assert decodable > 0.85
    assert random_labels < 0.7
    assert probe_accuracy(task, model, synthetic_probing_lines(2, False), layer=1) > 0.85


def test_layer_out_of_range(tiny):
    _, _, task, model = tiny
    dictionary = task.source_dictionary
    with pytest.raises(InputError, match="out of range"):
        encoder_features(model, batches(encode_lines(["w1 w2"], dictionary), dictionary),
                         dictionary.pad(), layer=9)


def test_probe_cli(tiny, tmp_path, capsys):
    pytest.importorskip("mlmha_fairseq.compat")
    from mlmha_fairseq.cli import probe

    data, cfg, _, model = tiny
    checkpoint = save_checkpoint(str(tmp_path / "model.pt"), cfg, model)
    task_file = tmp_path / "marker.txt"
    task_file.write_text("\n".join(synthetic_probing_lines(3, False)) + "\n", encoding="utf-8")
    prefix = str(tmp_path / "probe")
    common = [checkpoint, "--names", "tiny", "--data-bin", data, "--tasks", str(task_file)]
    probe.main(common + ["--classifier", "logreg", "--output-prefix", prefix])
    with open(prefix + ".csv", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    assert rows[0]["task"] == "marker" and float(rows[0]["test_accuracy"]) > 85
    assert (tmp_path / "probe.png").stat().st_size > 0
    # the default is the thesis MLP with chapter 4's schedule (too few examples here to learn
    # in its one step per epoch; test_thesis_mlp_learns_and_early_stops covers learning)
    probe.main(common + ["--output-prefix", prefix + "_mlp"])
    with open(prefix + "_mlp.json", encoding="utf-8") as handle:
        record = json.load(handle)
    assert (record["classifier"], record["thesis_chapter"]) == ("mlp", 4)
    assert record["results"][0]["setting"].startswith("hidden=")
