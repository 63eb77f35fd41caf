"""How much a translation model uses its source: the validation NLL of the references given
their own source against given another sentence's source, and how alike its hypotheses are.

A model that has learned to translate assigns its references a much lower NLL when it reads
their own source; a model that behaves as a target-side language model (the symptom of MLRF
Both-FNN-SA and Enc-DC after 400 updates, examples/mlrf/README.md) gains little from it. The
gain, in bits per target token, is ``(NLL(deranged sources) - NLL(true sources)) / tokens``,
teacher-forced. Sources are deranged within each batch, where fairseq batches sentences of
similar length, so that a borrowed source is of about the right length; a batch of one
sentence cannot be deranged and is left out of both sums.
"""
import math
import random
from collections import Counter
from dataclasses import dataclass
from typing import Dict, List, Sequence

import torch

DEFAULT_MAX_TOKENS = 4096
PREFIX_WORDS = 4


def derangement(size: int, rng: random.Random) -> List[int]:
    """A random permutation of ``range(size)`` with no fixed point (Sattolo's algorithm gives a
    single cycle through every index; ``size`` >= 2)."""
    order = list(range(size))
    for i in range(size - 1, 0, -1):
        j = rng.randrange(i)
        order[i], order[j] = order[j], order[i]
    return order


@dataclass
class SourceDependence:
    true_bits: float  # summed NLL of the references given their own sources, bits
    deranged_bits: float  # ... given other sentences' sources
    tokens: int  # target tokens (EOS included, padding not)
    sentences: int
    left_out: int  # sentences in batches of one

    @property
    def gain(self) -> float:
        """Bits per target token that the true source saves."""
        return (self.deranged_bits - self.true_bits) / self.tokens

    def as_dict(self) -> Dict:
        return {"nll_true_bits_per_token": self.true_bits / self.tokens,
                "nll_deranged_bits_per_token": self.deranged_bits / self.tokens,
                "gain_bits_per_token": self.gain, "tokens": self.tokens, "sentences": self.sentences,
                "left_out_sentences": self.left_out}


def _nll_bits(model, net_input: Dict, target: torch.Tensor, pad: int) -> float:
    with torch.no_grad():
        lprobs = model.get_normalized_probs(model(**net_input), log_probs=True)
    nll = -lprobs.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    return float(nll[target.ne(pad)].sum()) / math.log(2)


def source_dependence(model, task, split: str, seed: int = 1, max_tokens: int = DEFAULT_MAX_TOKENS
                      ) -> SourceDependence:
    """:class:`SourceDependence` of ``model`` (eval mode) on the loaded ``split`` of ``task``."""
    dataset = task.dataset(split)
    batches = task.get_batch_iterator(dataset=dataset, max_tokens=max_tokens, required_batch_size_multiple=1,
                                      seed=seed, ignore_invalid_inputs=True).next_epoch_itr(shuffle=False)
    rng, pad = random.Random(seed), task.target_dictionary.pad()
    result = SourceDependence(0.0, 0.0, 0, 0, 0)
    for sample in batches:
        size = sample["target"].size(0)
        if size < 2:
            result.left_out += size
            continue
        net_input = sample["net_input"]
        order = torch.tensor(derangement(size, rng))
        deranged = dict(net_input, src_tokens=net_input["src_tokens"][order],
                        src_lengths=net_input["src_lengths"][order])
        result.true_bits += _nll_bits(model, net_input, sample["target"], pad)
        result.deranged_bits += _nll_bits(model, deranged, sample["target"], pad)
        result.tokens += int(sample["target"].ne(pad).sum())
        result.sentences += size
    return result


def hypothesis_diversity(hypotheses: Sequence[str], prefix_words: int = PREFIX_WORDS) -> Dict:
    """How alike a system's outputs are: distinct hypotheses, and the largest group that starts
    with the same ``prefix_words`` words (with their share of all hypotheses)."""
    prefixes = Counter(" ".join(line.split()[:prefix_words]) for line in hypotheses)
    prefix, largest = prefixes.most_common(1)[0] if prefixes else ("", 0)
    return {"hypotheses": len(hypotheses), "distinct": len(set(hypotheses)),
            f"largest_same_first_{prefix_words}_words": largest, "that_prefix": prefix,
            "share": largest / len(hypotheses) if hypotheses else 0.0}
