"""The named systems of the demo, the benchmark and the experiment runner, in one list.

A system is a fairseq architecture and the options that select one mechanism; the model
size, data and training budget are added by the tool that runs it. Every system has a
``key`` (the benchmark's name, e.g. ``mlmha M-00``) and a ``name`` (the label of the demo's
tables, e.g. ``MLMHA M-00``); :func:`lookup` accepts either.
"""
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from mlmha_fairseq.models.joint_attention import MULTI_LAYER, TRANSPARENT
from mlmha_fairseq.models.layer_selection import ALL_LAYERS
from mlmha_fairseq.models.mma import MIXED
from mlmha_fairseq.models.representation_fusion import FNN, NONE, SA
from mlmha_fairseq.modules.input_combination import STRATEGIES as MULTI_SOURCE_STRATEGIES  # noqa: F401  (experiments.config)
from mlmha_fairseq.modules.layer_aggregation import C_AGG, ITER_C_AGG, ITER_S_AGG, S_AGG
from mlmha_fairseq.modules.multi_layer_attention import M_00, VARIANTS


QUICK, FULL = "quick", "full"  # in the demo's table always, or with --full only


@dataclass(frozen=True)
class ModelSize:
    """A model size of the tools (the same for encoder and decoder), with one embedding matrix
    shared three ways and dropout 0.1."""

    embed_dim: int
    ffn_embed_dim: int
    heads: int
    layers: int

    def options(self) -> List[str]:
        options = []
        for side in ("encoder", "decoder"):
            options += [f"--{side}-layers", self.layers, f"--{side}-embed-dim", self.embed_dim,
                        f"--{side}-ffn-embed-dim", self.ffn_embed_dim, f"--{side}-attention-heads", self.heads]
        return [str(option) for option in options] + ["--share-all-embeddings", "--dropout", "0.1"]


SIZES: Dict[str, ModelSize] = {
    "demo": ModelSize(embed_dim=128, ffn_embed_dim=512, heads=4, layers=3),  # the demo and the runner
    # the benchmark's; the documents' small and base Transformers (models/presets.py)
    "small": ModelSize(embed_dim=256, ffn_embed_dim=1024, heads=4, layers=4),
    "base": ModelSize(embed_dim=512, ffn_embed_dim=2048, heads=8, layers=6),
}


@dataclass
class System:
    name: str  # label in tables
    arch: str
    options: List[str] = field(default_factory=list)
    task_options: List[str] = field(default_factory=list)  # for fairseq-train and -generate
    sources: Tuple[str, ...] = ()  # of a multi-source system (its --source-langs)
    key: str = ""  # short name (the benchmark's); defaults to ``name``
    demo: Optional[str] = None  # in the demo's first table: QUICK, FULL, or None (not)
    test_options: Optional[Tuple[str, ...]] = None  # in the tests' table of mechanisms (tests/mechanisms.py)
    # with these options at the test size, or None (a variant the tests need not build again)

    def __post_init__(self):
        self.key = self.key or self.name

    @property
    def full_only(self) -> bool:
        """The demo runs it with --full only."""
        return self.demo == FULL


MLMHA = ["--decoder-cross-attention", MULTI_LAYER]
JOINT_LOSS = ["--criterion", "multi_decoder_label_smoothed_cross_entropy"]

# Every system of the package's tools, once, in the benchmark's order (the baseline first). A
# new mechanism is added here: the demo (``demo``), the benchmark, the experiment runner and the
# tests (``test_options``) take their lists from this table.
SYSTEMS: List[System] = [
    System("Transformer (fairseq)", "transformer", key="transformer", demo=QUICK),
    System("slot_transformer", "slot_transformer", test_options=()),
    *(System(f"MLMHA {variant}", "slot_transformer", MLMHA + ["--mlmha-variant", variant], key=f"mlmha {variant}",
             demo=QUICK if variant == M_00 else FULL, test_options=())
      for variant in VARIANTS),
    System("S-Agg", "slot_transformer", ["--layer-aggregation", S_AGG], key=f"aggregation {S_AGG}", demo=FULL,
           test_options=()),
    System("S-Agg (iterative)", "slot_transformer", ["--layer-aggregation", ITER_S_AGG],
           key=f"aggregation {ITER_S_AGG}", test_options=()),
    System("C-Agg", "slot_transformer", ["--layer-aggregation", C_AGG], key=f"aggregation {C_AGG}", test_options=()),
    System("Iter-C-Agg", "slot_transformer", ["--layer-aggregation", ITER_C_AGG], key=f"aggregation {ITER_C_AGG}",
           demo=FULL, test_options=()),
    System("Transparent Attention", "slot_transformer", ["--layer-aggregation", TRANSPARENT],
           key=f"aggregation {TRANSPARENT}", demo=FULL, test_options=()),
    # dynamic linear combination of layers (Wang et al. 2019), encoder side
    System("DLCL", "slot_transformer", ["--dlcl-encoder"], key="dlcl", test_options=()),
    System("MLRF Enc-FNN", "slot_transformer", ["--mlrf-encoder-fusion", FNN, "--mlrf-decoder-fusion", NONE],
           key="mlrf Enc-FNN", test_options=()),
    System("MLRF Dec-SA", "slot_transformer", ["--mlrf-encoder-fusion", NONE, "--mlrf-decoder-fusion", SA],
           key="mlrf Dec-SA"),
    System("MLRF Dec-SA + indep. W1", "slot_transformer",
           ["--mlrf-encoder-fusion", NONE, "--mlrf-decoder-fusion", SA, "--mlrf-indep-w1"],
           key="mlrf Dec-SA + indep. W1", test_options=()),
    System("MLRF Both-FNN-SA", "slot_transformer", ["--mlrf-encoder-fusion", FNN, "--mlrf-decoder-fusion", SA],
           key="mlrf Both-FNN-SA", demo=FULL),
    # H/4 heads each of G, L, F, B (the tests' model has 2 heads: 4 for one head of each type)
    System("MMA", "slot_transformer", ["--encoder-self-attention", MIXED], key="mma", demo=FULL,
           test_options=("--encoder-attention-heads", "4")),
    # Dual Contextual (thesis ch. 5, f = 2)
    System("Enc-DC", "slot_transformer", ["--dc-encoder-layers", ALL_LAYERS], key="dc encoder", demo=FULL),
    System("Dec-DC", "slot_transformer", ["--dc-decoder-layers", ALL_LAYERS], key="dc decoder"),
    System("Full-DC", "slot_transformer", ["--dc-encoder-layers", ALL_LAYERS, "--dc-decoder-layers", ALL_LAYERS],
           key="dc full", test_options=()),
    # multi-level supervision (thesis ch. 4, Table 4.6a), trained with the joint loss: without
    # AIF generation runs the main decoder only; with AIF the auxiliary decoders run in lock-step.
    System("MS-1", "ms_transformer", ["--aux-decoder-layers", "1", *JOINT_LOSS]),
    System("MS-1 + AIF", "ms_transformer", ["--aux-decoder-layers", "1", "--aux-fusion", *JOINT_LOSS]),
    System("MS-2 + AIF", "ms_transformer", ["--aux-decoder-layers", "2", "--aux-fusion", *JOINT_LOSS], demo=FULL),
    # the tests' model has 3 encoder layers: 4 for auxiliary decoders on layers 1, 2 and 3
    System("MS-123 + AIF", "ms_transformer", ["--aux-decoder-layers", "1,2,3", "--aux-fusion", *JOINT_LOSS],
           test_options=("--encoder-layers", "4")),
]
BASELINE = SYSTEMS[0]

# the demo's first table
DEMO_SYSTEMS: List[System] = [system for system in SYSTEMS if system.demo]


def by_name() -> Dict[str, System]:
    """Every system under its key and under its name."""
    table = {system.key: system for system in SYSTEMS}
    table.update({system.name: system for system in SYSTEMS})
    return table


def lookup(name: str) -> System:
    """The system called ``name`` (its key or its label); KeyError lists the known names."""
    table = by_name()
    if name not in table:
        raise KeyError(f"unknown system {name!r}; known: {', '.join(sorted(table))}")
    return table[name]


def multi_source_system(name: str, sources: Sequence[str], strategy: str, target: str) -> System:
    """The multi-source Transformer over ``sources`` with a combination strategy (MMA paper)."""
    task = ["--task", "multi_source_translation", "--source-langs", ",".join(sources), "--target-lang", target]
    return System(name, "multi_source_transformer", ["--combination-strategy", strategy],
                  task_options=task, sources=tuple(sources))
