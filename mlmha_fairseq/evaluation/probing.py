"""Probing classifiers on frozen encoder features (thesis ch. 5; Conneau et al.
2018, SentEval probing tasks).

Data: SentEval probing files, one example per line ``split<TAB>label<TAB>sentence`` with
split in ``tr`` (train), ``va`` (dev), ``te`` (test).
Features: mean over non-pad positions (EOS included, as the model sees it) of an encoder
layer's output, the encoder frozen.
Classifier: scikit-learn logistic regression (C tuned on dev) or a one-hidden-layer MLP
(hidden size tuned on dev over SentEval's grid, L2 1e-4 as in the thesis); test accuracy
of the dev-best setting is reported. The thesis trained its MLP with RMSProp and early
stopping; scikit-learn's MLP uses Adam.
"""
import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from mlmha_fairseq.evaluation.text_io import InputError, read_lines

SPLITS = ("tr", "va", "te")
CLASSIFIERS = ("logreg", "mlp")
LOGREG_C_GRID = (0.01, 0.1, 1.0, 10.0)
MLP_HIDDEN_GRID = (50, 100, 200)
MLP_L2 = 1e-4
MLP_MAX_EPOCHS = 100
LOGREG_MAX_ITER = 1000
FIELDS_PER_LINE = 3


@dataclass
class ProbingData:
    """Sentences and labels per split."""

    sentences: Dict[str, List[str]]
    labels: Dict[str, List[str]]


def parse_senteval(lines: Sequence[str], path: str = "probing file") -> ProbingData:
    """Parse SentEval probing lines; every split must be present."""
    sentences = {split: [] for split in SPLITS}
    labels = {split: [] for split in SPLITS}
    for number, line in enumerate(lines, start=1):
        fields = line.split("\t")
        if len(fields) != FIELDS_PER_LINE or fields[0] not in SPLITS:
            raise InputError(f"{path}:{number}: expected 'tr|va|te<TAB>label<TAB>sentence'")
        split, label, sentence = fields
        sentences[split].append(sentence)
        labels[split].append(label)
    empty = [split for split in SPLITS if not sentences[split]]
    if empty:
        raise InputError(f"{path}: no examples for split(s) {', '.join(empty)}")
    return ProbingData(sentences, labels)


def read_senteval(path: str) -> ProbingData:
    """Read a SentEval probing file."""
    return parse_senteval(read_lines(path), path)


def mean_pool(states: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
    """Mean over non-pad time steps: ``states [T, B, C]``, ``padding_mask [B, T]`` -> ``[B, C]``."""
    keep = (~padding_mask).t().unsqueeze(-1).to(states.dtype)
    return (states * keep).sum(0) / keep.sum(0)


def encoder_features(model, batches, pad: int, layer: Optional[int] = None) -> np.ndarray:
    """Mean-pooled encoder features, one row per sentence in batch order.

    ``layer=None``: the encoder output (``encoder_out``, after any final LayerNorm);
    an integer k: ``encoder_states[k]`` (0 = embeddings, k = output of layer k).
    """
    model.eval()
    features = []
    with torch.no_grad():
        for src_tokens, src_lengths in batches:
            out = model.encoder(src_tokens, src_lengths=src_lengths,
                                return_all_hiddens=layer is not None)
            if layer is None:
                states = out["encoder_out"][0]
            else:
                hidden = out["encoder_states"]
                if not 0 <= layer < len(hidden):
                    raise InputError(f"layer {layer} out of range: the encoder has states 0..{len(hidden) - 1}")
                states = hidden[layer]
            features.append(mean_pool(states, src_tokens.eq(pad)).float().numpy())
    return np.concatenate(features)


def _candidates(classifier: str, seed: int):
    from sklearn.linear_model import LogisticRegression
    from sklearn.neural_network import MLPClassifier
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    if classifier == "logreg":
        return [(f"C={c}", make_pipeline(StandardScaler(), LogisticRegression(
            C=c, max_iter=LOGREG_MAX_ITER, random_state=seed))) for c in LOGREG_C_GRID]
    if classifier == "mlp":
        return [(f"hidden={h}", make_pipeline(StandardScaler(), MLPClassifier(
            hidden_layer_sizes=(h,), alpha=MLP_L2, max_iter=MLP_MAX_EPOCHS, random_state=seed)))
            for h in MLP_HIDDEN_GRID]
    raise InputError(f"classifier must be one of {CLASSIFIERS}")


@dataclass
class ProbeResult:
    """Dev-selected setting and its dev/test accuracies (fractions)."""

    setting: str
    dev_accuracy: float
    test_accuracy: float


def fit_probe(features: Dict[str, np.ndarray], labels: Dict[str, Sequence[str]],
              classifier: str = "logreg", seed: int = 0) -> ProbeResult:
    """Train on ``tr``, choose the setting by ``va`` accuracy, report ``te`` accuracy."""
    from sklearn.exceptions import ConvergenceWarning

    if len(set(labels["tr"])) < 2:
        raise InputError("the training split needs at least two labels")
    best = None
    for setting, model in _candidates(classifier, seed):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            model.fit(features["tr"], labels["tr"])
        dev = model.score(features["va"], labels["va"])
        if best is None or dev > best[1]:
            best = (setting, dev, model)
    setting, dev, model = best
    return ProbeResult(setting, dev, model.score(features["te"], labels["te"]))
