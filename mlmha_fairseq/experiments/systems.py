"""The named systems of the demo, the benchmark and the experiment runner, in one list.

A system is a fairseq architecture and the options that select one mechanism; the model
size, data and training budget are added by the tool that runs it. Every system has a
``key`` (the benchmark's name, e.g. ``mlmha M-00``) and a ``name`` (the label of the demo's
tables, e.g. ``MLMHA M-00``); :func:`lookup` accepts either.
"""
from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple


@dataclass
class System:
    name: str  # label in tables
    arch: str
    options: List[str] = field(default_factory=list)
    full_only: bool = False  # the demo runs it with --full only
    task_options: List[str] = field(default_factory=list)  # for fairseq-train and -generate
    sources: Tuple[str, ...] = ()  # of a multi-source system (its --source-langs)
    key: str = ""  # short name (the benchmark's); defaults to ``name``

    def __post_init__(self):
        self.key = self.key or self.name


MLMHA = ["--decoder-cross-attention", "multi-layer"]
JOINT_LOSS = ["--criterion", "multi_decoder_label_smoothed_cross_entropy"]

SYSTEMS: List[System] = [
    System("Transformer (fairseq)", "transformer", key="transformer"),
    System("MLMHA M-00", "slot_transformer", MLMHA + ["--mlmha-variant", "M-00"], key="mlmha M-00"),
    System("Iter-C-Agg", "slot_transformer", ["--layer-aggregation", "iter-c-agg"], full_only=True,
           key="aggregation iter-c-agg"),
    System("MLMHA M-01", "slot_transformer", MLMHA + ["--mlmha-variant", "M-01"], full_only=True,
           key="mlmha M-01"),
    System("MLMHA M-10", "slot_transformer", MLMHA + ["--mlmha-variant", "M-10"], full_only=True,
           key="mlmha M-10"),
    System("MLMHA M-11", "slot_transformer", MLMHA + ["--mlmha-variant", "M-11"], full_only=True,
           key="mlmha M-11"),
    System("S-Agg", "slot_transformer", ["--layer-aggregation", "s-agg"], full_only=True, key="aggregation s-agg"),
    System("Transparent Attention", "slot_transformer", ["--layer-aggregation", "transparent"], full_only=True,
           key="aggregation transparent"),
    # H/4 heads each of G, L, F, B
    System("MMA", "slot_transformer", ["--encoder-self-attention", "mixed"], full_only=True, key="mma"),
    System("MLRF Both-FNN-SA", "slot_transformer", ["--mlrf-encoder-fusion", "fnn", "--mlrf-decoder-fusion", "sa"],
           full_only=True, key="mlrf Both-FNN-SA"),
    # Dual Contextual (thesis ch. 5, f = 2)
    System("Enc-DC", "slot_transformer", ["--dc-encoder-layers", "all"], full_only=True, key="dc encoder"),
    # multi-level supervision (thesis ch. 4, Table 4.6a), trained with the joint loss: without
    # AIF generation runs the main decoder only; with AIF the auxiliary decoders run in lock-step.
    System("MS-2 + AIF", "ms_transformer", ["--aux-decoder-layers", "2", "--aux-fusion", *JOINT_LOSS],
           full_only=True),
    # the benchmark's further configurations
    System("slot_transformer", "slot_transformer"),
    System("S-Agg (iterative)", "slot_transformer", ["--layer-aggregation", "iter-s-agg"],
           key="aggregation iter-s-agg"),
    System("C-Agg", "slot_transformer", ["--layer-aggregation", "c-agg"], key="aggregation c-agg"),
    System("MLRF Enc-FNN", "slot_transformer", ["--mlrf-encoder-fusion", "fnn", "--mlrf-decoder-fusion", "none"],
           key="mlrf Enc-FNN"),
    System("MLRF Dec-SA", "slot_transformer", ["--mlrf-encoder-fusion", "none", "--mlrf-decoder-fusion", "sa"],
           key="mlrf Dec-SA"),
    System("MLRF Dec-SA + indep. W1", "slot_transformer",
           ["--mlrf-encoder-fusion", "none", "--mlrf-decoder-fusion", "sa", "--mlrf-indep-w1"],
           key="mlrf Dec-SA + indep. W1"),
    System("Dec-DC", "slot_transformer", ["--dc-decoder-layers", "all"], key="dc decoder"),
    System("Full-DC", "slot_transformer", ["--dc-encoder-layers", "all", "--dc-decoder-layers", "all"],
           key="dc full"),
    System("MS-1", "ms_transformer", ["--aux-decoder-layers", "1", *JOINT_LOSS]),
    System("MS-1 + AIF", "ms_transformer", ["--aux-decoder-layers", "1", "--aux-fusion", *JOINT_LOSS]),
    System("MS-123 + AIF", "ms_transformer", ["--aux-decoder-layers", "1,2,3", "--aux-fusion", *JOINT_LOSS]),
    # dynamic linear combination of layers (Wang et al. 2019), encoder side
    System("DLCL", "slot_transformer", ["--dlcl-encoder"], key="dlcl"),
]
BASELINE = SYSTEMS[0]

# the demo's first table, in its order
DEMO_SYSTEMS: List[System] = SYSTEMS[:12]

# the benchmark's configurations, in its order
BENCHMARK_KEYS = (
    "transformer", "slot_transformer", "mlmha M-00", "mlmha M-01", "mlmha M-10", "mlmha M-11",
    "aggregation s-agg", "aggregation iter-s-agg", "aggregation c-agg", "aggregation iter-c-agg",
    "aggregation transparent", "dlcl", "mlrf Enc-FNN", "mlrf Dec-SA", "mlrf Dec-SA + indep. W1", "mlrf Both-FNN-SA",
    "mma", "dc encoder", "dc decoder", "dc full", "MS-1", "MS-1 + AIF", "MS-123 + AIF",
)


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


MULTI_SOURCE_STRATEGIES = ("serial", "parallel", "flat", "hierarchical")


def multi_source_system(name: str, sources: Sequence[str], strategy: str, target: str) -> System:
    """The multi-source Transformer over ``sources`` with a combination strategy (MMA paper)."""
    task = ["--task", "multi_source_translation", "--source-langs", ",".join(sources), "--target-lang", target]
    return System(name, "multi_source_transformer", ["--combination-strategy", strategy],
                  task_options=task, sources=tuple(sources))
