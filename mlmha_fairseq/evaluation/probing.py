"""Probing classifiers on frozen encoder features (thesis ch. 5; Conneau et al.
2018, SentEval probing tasks).

Data: SentEval probing files, one example per line ``split<TAB>label<TAB>sentence`` with
split in ``tr`` (train), ``va`` (dev), ``te`` (test).
Features: mean over non-pad positions (EOS included, as the model sees it) of an encoder
layer's output, the encoder frozen.
Classifier: the thesis' two-layer MLP (thesis §4.5.4 and §5.6.1: L2 1e-4 on the hidden
layer, RMSProp, at most 100 epochs, early stopping on dev accuracy; learning rate 1e-3 and
batch 512 in chapter 4, 2.5e-4 and 64 in chapter 5), written in torch because scikit-learn's
MLP offers no RMSProp and no early stopping on a given dev set; or scikit-learn logistic
regression (C tuned on dev). The thesis does not give the hidden size: it is tuned on dev
over SentEval's grid. Test accuracy of the dev-best setting is reported.
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
# Epochs without a better dev accuracy before stopping: not given in the thesis; SentEval's
# default ("tenacity", Conneau and Kiela 2018).
MLP_PATIENCE = 5
LOGREG_MAX_ITER = 1000
FIELDS_PER_LINE = 3


@dataclass(frozen=True)
class MLPSchedule:
    """Optimiser settings of the thesis' probing MLP."""

    learning_rate: float
    batch_size: int


# thesis §4.5.4 (chapter 4, MS-l encoders) and §5.6.1 (chapter 5, Enc-DC encoders)
THESIS_MLP_SCHEDULES = {4: MLPSchedule(1e-3, 512), 5: MLPSchedule(2.5e-4, 64)}
DEFAULT_THESIS_CHAPTER = 4


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


def _logreg_candidates(seed: int):
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    return [(f"C={c}", make_pipeline(StandardScaler(), LogisticRegression(
        C=c, max_iter=LOGREG_MAX_ITER, random_state=seed))) for c in LOGREG_C_GRID]


@dataclass
class MLPRun:
    """A trained probing MLP (the dev-best epoch's weights) and how its training went."""

    model: torch.nn.Module
    dev_accuracy: float
    best_epoch: int
    epochs_run: int


def _accuracy(model: torch.nn.Module, features: torch.Tensor, targets: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        return model(features).argmax(-1).eq(targets).float().mean().item()


def train_mlp(features: Dict[str, torch.Tensor], targets: Dict[str, torch.Tensor], classes: int,
              hidden: int, schedule: MLPSchedule, seed: int = 0,
              max_epochs: int = MLP_MAX_EPOCHS, patience: int = MLP_PATIENCE) -> MLPRun:
    """The thesis' two-layer probing MLP trained on ``tr`` with early stopping on ``va``.

    input -> Linear(hidden) -> sigmoid -> Linear(classes) (SentEval's probing MLP; the thesis
    does not name the activation), cross-entropy, RMSProp, L2 ``MLP_L2`` on the hidden layer
    only (thesis §4.5.4). Stops after ``patience`` epochs without a better dev accuracy and
    returns the weights of the best one.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():  # seeded initialisation without touching the global RNG
        torch.manual_seed(seed)
        hidden_layer = torch.nn.Linear(features["tr"].shape[1], hidden)
        output_layer = torch.nn.Linear(hidden, classes)
    model = torch.nn.Sequential(hidden_layer, torch.nn.Sigmoid(), output_layer)
    optimizer = torch.optim.RMSprop([{"params": hidden_layer.parameters(), "weight_decay": MLP_L2},
                                     {"params": output_layer.parameters(), "weight_decay": 0.0}],
                                    lr=schedule.learning_rate)
    run = MLPRun(model, -1.0, 0, 0)
    best_state = None
    train_x, train_y = features["tr"], targets["tr"]
    for epoch in range(1, max_epochs + 1):
        model.train()
        for batch in torch.randperm(len(train_y), generator=generator).split(schedule.batch_size):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(train_x[batch]), train_y[batch]).backward()
            optimizer.step()
        dev = _accuracy(model, features["va"], targets["va"])
        run.epochs_run = epoch
        if dev > run.dev_accuracy:
            run.dev_accuracy, run.best_epoch = dev, epoch
            best_state = {name: value.clone() for name, value in model.state_dict().items()}
        elif epoch - run.best_epoch >= patience:
            break
    model.load_state_dict(best_state)
    return run


@dataclass
class ProbeResult:
    """Dev-selected setting and its dev/test accuracies (fractions)."""

    setting: str
    dev_accuracy: float
    test_accuracy: float


def _fit_logreg(features, labels, seed: int) -> ProbeResult:
    from sklearn.exceptions import ConvergenceWarning

    best = None
    for setting, model in _logreg_candidates(seed):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            model.fit(features["tr"], labels["tr"])
        dev = model.score(features["va"], labels["va"])
        if best is None or dev > best[1]:
            best = (setting, dev, model)
    setting, dev, model = best
    return ProbeResult(setting, dev, model.score(features["te"], labels["te"]))


def _fit_mlp(features, labels, seed: int, schedule: MLPSchedule) -> ProbeResult:
    names = sorted(set(labels["tr"]))
    index = {name: i for i, name in enumerate(names)}
    # a dev/test label never seen in training gets an index no output produces (always wrong)
    targets = {split: torch.tensor([index.get(label, len(names)) for label in labels[split]])
               for split in SPLITS}
    tensors = {split: torch.as_tensor(np.asarray(features[split]), dtype=torch.float32)
               for split in SPLITS}
    best = None
    for hidden in MLP_HIDDEN_GRID:
        run = train_mlp(tensors, targets, len(names), hidden, schedule, seed)
        if best is None or run.dev_accuracy > best[1].dev_accuracy:
            best = (f"hidden={hidden}, epoch={run.best_epoch}", run)
    setting, run = best
    return ProbeResult(setting, run.dev_accuracy, _accuracy(run.model, tensors["te"], targets["te"]))


def fit_probe(features: Dict[str, np.ndarray], labels: Dict[str, Sequence[str]],
              classifier: str = "logreg", seed: int = 0,
              chapter: int = DEFAULT_THESIS_CHAPTER) -> ProbeResult:
    """Train on ``tr``, choose the setting by ``va`` accuracy, report ``te`` accuracy.

    ``chapter`` picks the thesis chapter's MLP learning rate and batch size.
    """
    if len(set(labels["tr"])) < 2:
        raise InputError("the training split needs at least two labels")
    if classifier == "logreg":
        return _fit_logreg(features, labels, seed)
    if classifier == "mlp":
        return _fit_mlp(features, labels, seed, THESIS_MLP_SCHEDULES[chapter])
    raise InputError(f"classifier must be one of {CLASSIFIERS}")
