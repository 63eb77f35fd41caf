"""Speed, FLOPs and memory of this package's models against fairseq's transformer, one
configuration at a time: the measurements of ``python -m mlmha_fairseq.cli.benchmark``, whose
``--help`` says what each number is, and which runs each of them in a process of its own."""
import os
import resource
import time
from statistics import median
from typing import Dict, List, Tuple

import torch

from mlmha_fairseq.experiments.systems import SIZES, SYSTEMS

BASELINE = SYSTEMS[0].key

# name -> (architecture, options), from the package's one list of systems; the fixed size
# is set by --size on top of these.
CONFIGURATIONS: Dict[str, Tuple[str, List[str]]] = {system.key: (system.arch, system.options) for system in SYSTEMS}

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def size_options(size: str) -> List[str]:
    return SIZES[size].options()


def build(name: str, size: str, vocab_size: int, dtype: str = "fp32"):
    """The model, its training criterion, dictionary and configuration, built as
    fairseq-train builds them (with Adam, and ``--fp16`` / ``--bf16`` for a half type)."""
    from fairseq import options, tasks
    from fairseq.data import Dictionary
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    import mlmha_fairseq

    arch, extra = CONFIGURATIONS[name]
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(
        parser,
        ["unused", "--task", "translation", "--user-dir", os.path.dirname(mlmha_fairseq.__file__),
         "--arch", arch, "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
         "--optimizer", "adam", *size_options(size), *extra, *([f"--{dtype}"] if dtype != "fp32" else [])],
    )
    args.tpu = False  # fairseq's parser turns --bf16 into --tpu
    dictionary = Dictionary()
    for i in range(vocab_size - dictionary.nspecial):
        dictionary.add_symbol(f"w{i}")
    task = tasks.translation.TranslationTask(args, dictionary, dictionary)
    return task.build_model(args), task.build_criterion(args), dictionary, convert_namespace_to_omegaconf(args)


def random_sample(dictionary, sentences: int, length: int, device):
    """A training batch of random tokens, every sentence ``length`` tokens long."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(dictionary.nspecial, len(dictionary), (sentences, length), generator=gen)
    tokens[:, -1] = dictionary.eos()
    net_input = {
        "src_tokens": tokens.to(device),
        "src_lengths": torch.full((sentences,), length, device=device),
        "prev_output_tokens": torch.roll(tokens, 1, dims=1).to(device),
    }
    return {"net_input": net_input, "target": tokens.to(device), "ntokens": sentences * length,
            "nsentences": sentences}


class Subject:
    """One configuration ready to time: a training step (forward, criterion, backward,
    Adam) and beam search forced to ``length`` tokens, so that every system decodes as much."""

    def __init__(self, name: str, opts, device):
        from fairseq.optim import FP16Optimizer
        from fairseq.sequence_generator import SequenceGenerator

        torch.manual_seed(0)
        self.name = name
        self.model, self.criterion, dictionary, cfg = build(name, opts.size, opts.vocab_size, opts.dtype)
        self.model.to(device=device, dtype=DTYPES[opts.dtype])
        self.sample = random_sample(dictionary, opts.sentences, opts.length, device)
        params = list(self.model.parameters())
        if opts.dtype == "fp32":
            self.optimizer = torch.optim.Adam(params)
        else:
            # fairseq's flat fp32 master copy is CUDA-only; one fp32 copy per tensor elsewhere
            cfg.common.fp16_no_flatten_grads = device.type != "cuda"
            self.optimizer = FP16Optimizer.build_optimizer(cfg, params)
        self.beam = opts.beam
        self.generator = SequenceGenerator([self.model], dictionary, beam_size=opts.beam,
                                           max_len_a=0, max_len_b=opts.length, min_len=opts.length)
        net_input = self.sample["net_input"]
        self.gen_sample = {"net_input": {key: net_input[key][: opts.gen_sentences]
                                         for key in ("src_tokens", "src_lengths")}}

    def train_step(self):
        self.model.train()
        self.optimizer.zero_grad()
        loss, _, _ = self.criterion(self.model, self.sample)
        if isinstance(self.optimizer, torch.optim.Optimizer):
            loss.backward()
        else:
            self.optimizer.backward(loss)  # scaled by fairseq's loss scaler for fp16
        self.optimizer.step()

    def generate(self):
        """Beam search as fairseq-generate runs it: after ``prepare_for_inference_`` (no
        attention weights but the alignment layer's, beamable cross-attention), which
        forbids training afterwards, so every training measurement comes first."""
        if not self.model._is_generation_fast:
            self.model.make_generation_fast_(beamable_mm_beam_size=self.beam, need_attn=False)
        self.model.eval()
        with torch.no_grad():
            self.generator.generate([self.model], self.gen_sample)

    def flops(self, action: str) -> int:
        """FLOPs of one call of ``action`` (``train_step`` or ``generate``)."""
        from torch.utils.flop_counter import FlopCounterMode

        with FlopCounterMode(display=False) as counter:
            getattr(self, action)()
        return counter.get_total_flops()


def seconds(call, device) -> float:
    """Wall time of ``call()``; on CUDA, between two CUDA events around it."""
    if device.type != "cuda":
        start = time.perf_counter()
        call()
        return time.perf_counter() - start
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000


def interleaved_seconds(subjects: List[Subject], action: str, repeats: int, device) -> List[float]:
    """Median seconds of ``action`` per subject, the subjects alternating call by call so
    that a change of machine load affects them alike (after one warm-up call each).
    Not ``torch.utils.benchmark.Timer``: it times one statement's runs back to back."""
    times = [[] for _ in subjects]
    for repeat in range(repeats + 1):
        for subject, collected in zip(subjects, times):
            elapsed = seconds(getattr(subject, action), device)
            if repeat > 0:
                collected.append(elapsed)
    return [median(t) for t in times]


# profiler names of the kernels behind F.scaled_dot_product_attention, most specific first
SDPA_BACKENDS = [("cudnn_attention", "cudnn"), ("flash_attention_for_cpu", "flash (cpu)"),
                 ("flash_attention", "flash"), ("efficient_attention", "efficient"), ("attention_math", "math")]


def sdpa_backend(subject: Subject, opts) -> str:
    """The ``scaled_dot_product_attention`` backend of MLMHA's attention in training, at this
    shape, device and type (read from the profiler's operator names); "" without MLMHA."""
    from torch.profiler import profile

    from mlmha_fairseq.modules.multi_layer_attention import MultiLayerMultiheadAttention

    module = next((m for m in subject.model.modules() if isinstance(m, MultiLayerMultiheadAttention)), None)
    if module is None:
        return ""
    parameter = next(module.parameters())
    shape = (opts.length, opts.sentences, module.embed_dim)
    query = torch.randn(shape, device=parameter.device, dtype=parameter.dtype)
    taps = torch.randn((module.num_taps, *shape), device=parameter.device, dtype=parameter.dtype)
    no_pads = torch.zeros(opts.sentences, opts.length, dtype=torch.bool, device=parameter.device)
    module.train()
    with profile() as profiler:
        module(query, taps, taps, key_padding_mask=no_pads)
    names = {event.key for event in profiler.key_averages()}
    for fragment, backend in SDPA_BACKENDS:
        if any(fragment in name for name in names):
            return backend
    return "none"


def measure_speed(name: str, opts) -> dict:
    """Speed and FLOPs of ``name`` and of the baseline, measured together in this process."""
    device = torch.device(opts.device)
    subjects = [Subject(BASELINE, opts, device)] + ([Subject(name, opts, device)] if name != BASELINE else [])
    train = interleaved_seconds(subjects, "train_step", opts.steps, device)
    train_flops = [subject.flops("train_step") for subject in subjects]
    backend = sdpa_backend(subjects[-1], opts)
    generate = interleaved_seconds(subjects, "generate", max(1, opts.steps // 2), device)
    gen_flops = [subject.flops("generate") for subject in subjects]
    return {
        "name": name,
        "sdpa_backend": backend,
        "params": sum(p.numel() for p in subjects[-1].model.parameters()),
        "train_tokens_per_s": opts.sentences * opts.length / train[-1],
        "gen_sentences_per_s": opts.gen_sentences / generate[-1],
        "train_time_ratio": train[-1] / train[0],
        "gen_time_ratio": generate[-1] / generate[0],
        "flop_ratio": train_flops[-1] / train_flops[0],
        "gen_flop_ratio": gen_flops[-1] / gen_flops[0],
    }


def measure_memory(name: str, opts) -> float:
    """Peak memory (MiB) of one training step and one beam search of ``name`` alone: CUDA's
    peak allocation, or on CPU the process's peak resident set (interpreter included)."""
    device = torch.device(opts.device)
    subject = Subject(name, opts, device)
    subject.train_step()
    subject.generate()
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # KiB on Linux


def with_ratios(rows: List[dict]) -> List[dict]:
    base = next(row for row in rows if row["name"] == BASELINE)
    for row in rows:
        row["memory_ratio"] = row["peak_memory_mb"] / base["peak_memory_mb"]
        row["param_ratio"] = row["params"] / base["params"]
    return rows


COLUMNS = ["name", "sdpa_backend", "params", "param_ratio", "flop_ratio", "train_time_ratio", "gen_flop_ratio", "gen_time_ratio",
           "memory_ratio", "train_tokens_per_s", "gen_sentences_per_s", "peak_memory_mb"]


def markdown_table(rows: List[dict]) -> str:
    header = ("| configuration | params | train FLOPs x | train time x | generation FLOPs x "
              "| generation time x | peak memory x | train tok/s | gen sent/s | MLMHA's SDPA kernel |\n"
              "|---|---|---|---|---|---|---|---|---|---|\n")
    return header + "".join(
        f"| {r['name']} | {r['params'] / 1e6:.2f}M | {r['flop_ratio']:.2f} | {r['train_time_ratio']:.2f} "
        f"| {r['gen_flop_ratio']:.2f} | {r['gen_time_ratio']:.2f} | {r['memory_ratio']:.2f} "
        f"| {r['train_tokens_per_s']:.0f} "
        f"| {r['gen_sentences_per_s']:.2f} | {r['sdpa_backend']} |\n"
        for r in rows
    )


def plot(rows: List[dict], path: str):
    """Bars of the FLOP and time ratios per configuration, 1 = fairseq's transformer."""
    from mlmha_fairseq.evaluation.plotting import pyplot, save_figure

    bars = [("flop_ratio", "training FLOPs"), ("train_time_ratio", "training time"),
            ("gen_flop_ratio", "generation FLOPs"), ("gen_time_ratio", "generation time")]
    width = 0.8 / len(bars)
    figure, axis = pyplot().subplots(figsize=(12, 4))
    for offset, (key, label) in enumerate(bars):
        positions = [i + (offset - (len(bars) - 1) / 2) * width for i in range(len(rows))]
        axis.bar(positions, [row[key] for row in rows], width, label=label)
    axis.axhline(1.0, color="black", linewidth=0.8)
    axis.set_xticks(range(len(rows)), [row["name"] for row in rows], rotation=35, ha="right")
    axis.set_ylabel(f"ratio to fairseq's {BASELINE}")
    axis.legend()
    save_figure(figure, path)
