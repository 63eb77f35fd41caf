"""A checkpoint cannot run code through any of its stored options, whatever the option is called.

Real checkpoints of this package's three models and of fairseq's ``transformer``, each as
``fairseq-train`` (options in an ``argparse.Namespace``) and ``fairseq-hydra-train`` (plain
dicts) store them, get a payload planted in one option at a time: every string- or None-valued
option at any depth of their options (Namespace attributes, sub-dicts such as the transformer
config's ``encoder``/``decoder``, every section of ``cfg``), and the variants fairseq evaluates
under a name of its own (``encoder_xformers_att_config`` becomes ``cfg.encoder.xformers_att_config``;
a ``decoder`` sub-dict). Each planted file goes through the loading path of fairseq-generate
(``checkpoint_utils.load_model_ensemble`` with the task of the command line) and that of
fairseq-interactive and the hub (``load_model_ensemble_and_task``, the task from the checkpoint).
The payload would create a sentinel file if it ran: none may appear, and a refusal is one line
naming the option. The same sweep on the code before compat's value checks ran the payload
(``encoder_xformers_att_config``, issue 44). The sweep takes minutes: ``make security`` runs it
(it is skipped otherwise); the multi-source entry points below run in the suite."""
import copy
import os
import subprocess
import sys

import pytest
import torch
from fairseq import checkpoint_utils, options, tasks
from fairseq.models.transformer import TransformerConfig
from omegaconf import OmegaConf

from fairseq_helpers import (
    TINY_MODEL_ARGS, USER_DIR, binarize_n_way, preprocess, run_fairseq, train_args, write_n_way_text,
    write_reversal_corpus,
)
from mlmha_fairseq.compat import REFUSED, UnsafeCheckpointError

HYDRA_CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "hydra")
MULTI_SOURCE_TASK = ["--task", "multi_source_translation", "--source-langs", "s1,s2", "--target-lang", "tgt"]


def payload(sentinel) -> str:
    return f"__import__('os').system('touch {sentinel}') or [5]"


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpora")
    (root / "text").mkdir()
    write_reversal_corpus(root / "text")
    preprocess(root / "text", root / "bin")
    (root / "n_way").mkdir()
    write_n_way_text(root / "n_way")
    binarize_n_way(root / "n_way", root / "n_way_bin")
    return {"text": root / "bin", "n_way": root / "n_way_bin"}


def hydra_train(config, data, save_dir, *overrides):
    result = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "fairseq-hydra-train"), "--config-dir", HYDRA_CONFIGS,
         "--config-name", config, f"task.data={data}", f"checkpoint.save_dir={save_dir}", "common.cpu=true",
         "optimization.max_update=1", "dataset.max_tokens=400", "dataset.num_workers=0", *overrides],
        capture_output=True, text=True, cwd=save_dir.parent, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    return save_dir / "checkpoint_last.pt"


def as_transformer_config(checkpoint, save_dir):
    """A copy of a checkpoint of fairseq's ``transformer`` whose model options are its
    ``TransformerConfig`` as a dict (with the ``encoder``/``decoder`` sub-dicts fairseq reads)."""
    state = torch.load(checkpoint, weights_only=False)
    config = TransformerConfig.from_namespace(state["cfg"]["model"])
    state["cfg"]["model"] = {**OmegaConf.to_container(OmegaConf.structured(config), enum_to_str=True),
                             "_name": "transformer"}
    torch.save(state, save_dir / "checkpoint_last.pt")
    return save_dir / "checkpoint_last.pt"


def tiny(arch_options):
    return [f"model.{flag[2:].replace('-', '_')}={value}" for flag, value in zip(arch_options[::2], arch_options[1::2])]


# model: (corpus, fairseq-train options, task options of fairseq-generate, hydra config and overrides);
# fairseq ships no hydra config for its translation transformer: its dict form is its
# TransformerConfig as fairseq-hydra-train would store it (:func:`as_transformer_config`)
MODELS = {
    "transformer": ("text", ["transformer"], [], None),
    "slot_transformer": ("text", ["mlmha_transformer_iwslt", "--mlmha-variant", "M-10"], [],
                         ("translation", "model=mlmha_transformer_iwslt", "model.mlmha_variant=M-10",
                          *tiny(TINY_MODEL_ARGS))),
    "ms_transformer": ("text", ["ms_transformer_iwslt", "--aux-decoder-layers", "1", "--criterion",
                                "multi_decoder_label_smoothed_cross_entropy"], [],
                       ("multi_level_supervision", "model.aux_decoder_layers=1", *tiny(TINY_MODEL_ARGS))),
    "multi_source_transformer": ("n_way", ["multi_source_transformer", *MULTI_SOURCE_TASK], MULTI_SOURCE_TASK,
                                 ("multi_source_translation", "task.source_langs='s1,s2'", "task.target_lang=tgt",
                                  *tiny(TINY_MODEL_ARGS))),
}
CHECKPOINTS = [(model, form) for model in MODELS for form in ("argparse", "hydra")]


@pytest.fixture(scope="module")
def checkpoints(corpora, tmp_path_factory):
    """``checkpoint(model, form)``: trained (one update) the first time it is asked for."""
    trained = {}

    def checkpoint(model, form):
        if (model, form) not in trained:
            corpus, train_options, _task, hydra = MODELS[model]
            save_dir = tmp_path_factory.mktemp(f"{model}-{form}")
            if form == "argparse":
                arch, *extra = train_options
                run_fairseq("train", *train_args(corpora[corpus], save_dir, arch, *extra, max_update=1))
                trained[model, form] = save_dir / "checkpoint_last.pt"
            elif hydra is None:
                trained[model, form] = as_transformer_config(checkpoint(model, "argparse"), save_dir)
            else:
                trained[model, form] = hydra_train(hydra[0], corpora[corpus], save_dir, *hydra[1:])
        return trained[model, form]
    return checkpoint


def leaves(value, path=()):
    """``(path, value)`` of every string or None at any depth of ``value`` (Namespaces, dicts, lists)."""
    fields = vars(value) if hasattr(value, "__dict__") and not isinstance(value, type) else value
    if isinstance(fields, dict):
        for key, item in fields.items():
            yield from leaves(item, (*path, key))
    elif isinstance(fields, (list, tuple)):
        for index, item in enumerate(fields):
            yield from leaves(item, (*path, index))
    elif fields is None or isinstance(fields, str):
        yield path, fields


def plant(state, path, value):
    """``state`` with ``value`` at ``path`` (keys of dicts, attributes of Namespaces, indices)."""
    *parents, last = path
    holder = state
    for key in parents:
        holder = holder[key] if isinstance(holder, (dict, list, tuple)) else getattr(holder, key)
    if isinstance(holder, (dict, list)):
        holder[last] = value
    else:
        setattr(holder, last, value)


# the sections of the stored options that the loading paths read (the model's and the task's
# options, and the legacy ``args`` that fairseq converts into them): planted one option at a time
READ_WHEN_LOADING = (("args",), ("cfg", "model"), ("cfg", "task"))


def plantings(state):
    """The groups of option paths planted together: every option of the sections the loading
    paths read alone; the options of each other section of ``cfg`` (``common``, ``dataset``,
    ...) together, which no loading path reads, so that one load covers a section."""
    groups, others = [], {}
    for root in ("args", "cfg"):
        for path, _value in leaves(state.get(root), (root,)):
            if any(path[:len(section)] == section for section in READ_WHEN_LOADING):
                groups.append([path])
            else:
                others.setdefault(path[:2], []).append(path)
    return groups + list(others.values())


# what fairseq evaluates under a name of its own, planted where a Namespace stores no such key
VARIANTS = [("cfg", "model", "encoder_xformers_att_config"), ("cfg", "model", "decoder_xformers_att_config"),
            ("cfg", "model", "decoder", "xformers_att_config")]


def generate_task(data, task_options):
    """The task fairseq-generate builds from its command line."""
    args = options.parse_args_and_arch(options.get_generation_parser(), [
        str(data), "--user-dir", USER_DIR, "--path", "unused.pt", "--cpu", *task_options])
    return tasks.setup_task(args)


def load_as_generate(checkpoint, task):
    """fairseq-generate's loading path: the task from the command line, the models from the file."""
    return checkpoint_utils.load_model_ensemble([str(checkpoint)], task=task)


def load_as_interactive(checkpoint, data):
    """fairseq-interactive's (and the hub's) loading path: the task built from the file's options."""
    return checkpoint_utils.load_model_ensemble_and_task([str(checkpoint)], arg_overrides={"data": str(data)})


def assert_refused_naming(error: UnsafeCheckpointError, path):
    line = str(error)
    assert "\n" not in line and (REFUSED in line)
    assert f"{path[-1]}=" in line, (path, line)


@pytest.mark.exhaustive
@pytest.mark.parametrize("model,form", CHECKPOINTS, ids=[f"{m}-{f}" for m, f in CHECKPOINTS])
def test_no_stored_option_runs_code_whatever_its_name(checkpoints, corpora, tmp_path, model, form):
    original = checkpoints(model, form)
    corpus, _train, task_options, _hydra = MODELS[model]
    state = torch.load(original, weights_only=False)
    task = generate_task(corpora[corpus], task_options)
    groups = plantings(state)
    assert sum(map(len, groups)) > 60, "the sweep found too few options: it no longer reads the checkpoint"
    if form == "argparse":
        groups += [[path] for path in VARIANTS]
    refused = 0
    for number, group in enumerate(groups):
        sentinel = tmp_path / f"ran-{number}"
        planted_state = copy.deepcopy(state)
        for path in group:
            if path[-2:] == ("decoder", "xformers_att_config") and form == "argparse":
                plant(planted_state, path[:-1], {"xformers_att_config": payload(sentinel)})
            else:
                plant(planted_state, path, payload(sentinel))
        malicious = tmp_path / f"planted-{number}.pt"
        torch.save(planted_state, malicious)
        loads = [lambda: load_as_generate(malicious, task)]
        if group[0][:2] != ("cfg", "model"):  # the task built from the file's options: only interactive's path
            loads.append(lambda: load_as_interactive(malicious, corpora[corpus]))
        for load in loads:
            try:
                load()
            except UnsafeCheckpointError as error:
                if len(group) == 1:
                    assert_refused_naming(error, group[0])
                refused += 1
            except Exception:  # a payload where fairseq expects a name or a number: fairseq's own error
                pass
            assert not sentinel.exists(), f"{'.'.join(map(str, group[0]))}: the planted code ran"
        malicious.unlink()
    if form == "argparse":  # every option of a Namespace is checked on unpickling: all refused
        assert refused >= len([group for group in groups if group[0][:2] == ("cfg", "model")])


@pytest.mark.exhaustive
@pytest.mark.parametrize("model,form", CHECKPOINTS, ids=[f"{m}-{f}" for m, f in CHECKPOINTS])
@pytest.mark.parametrize("name", ["xformers_att_config", "adaptive_softmax_cutoff"])
def test_what_fairseq_evaluates_is_refused_naming_it(checkpoints, corpora, tmp_path, model, form, name):
    """The options the transformer family evaluates (``eval_str_dict``/``eval_str_list``),
    planted where fairseq reads them for this form (the transformer config's sub-dicts for a
    hydra checkpoint of fairseq's transformer), are refused on both loading paths."""
    corpus, _train, task_options, _hydra = MODELS[model]
    state = torch.load(checkpoints(model, form), weights_only=False)
    task = generate_task(corpora[corpus], task_options)
    model_options = state["cfg"]["model"]
    nested = isinstance(model_options, dict) and isinstance(model_options.get("decoder"), dict)
    if name == "adaptive_softmax_cutoff":  # a decoder option at the top of the transformer config too
        sides = [(name,)]
    else:
        sides = [("encoder", name), ("decoder", name)] if nested else [(f"encoder_{name}",), (f"decoder_{name}",)]
    for side in sides:
        sentinel = tmp_path / f"ran-{'-'.join(side)}"
        planted = copy.deepcopy(state)
        plant(planted, ("cfg", "model", *side), payload(sentinel))
        malicious = tmp_path / "planted.pt"
        torch.save(planted, malicious)
        for load in (lambda: load_as_generate(malicious, task), lambda: load_as_interactive(malicious, corpora[corpus])):
            with pytest.raises(UnsafeCheckpointError) as refused:
                load()
            assert_refused_naming(refused.value, side)
            assert not sentinel.exists()


# the variants of issue 44 through the multi-source model's own entry points
MULTI_SOURCE_VARIANTS = [("argparse", ("encoder_xformers_att_config",)), ("argparse", ("decoder_xformers_att_config",)),
                         ("argparse", ("decoder", "xformers_att_config")), ("hydra", ("encoder_xformers_att_config",))]


@pytest.mark.parametrize("form,field", MULTI_SOURCE_VARIANTS, ids=[f"{f}-{'.'.join(p)}" for f, p in MULTI_SOURCE_VARIANTS])
def test_multi_source_interactive_and_hub_refuse_code_naming_it(checkpoints, corpora, tmp_path, form, field):
    from mlmha_fairseq.models.multi_source import MultiSourceTransformerModel

    sentinel = tmp_path / "ran"
    state = torch.load(checkpoints("multi_source_transformer", form), weights_only=False)
    if len(field) == 2:
        plant(state, ("cfg", "model", field[0]), {field[1]: payload(sentinel)})
    else:
        plant(state, ("cfg", "model", *field), payload(sentinel))
    (tmp_path / "ckpt").mkdir()
    malicious = tmp_path / "ckpt" / "planted.pt"
    torch.save(state, malicious)
    result = run_fairseq("interactive", corpora["n_way"], "--user-dir", USER_DIR, "--path", malicious, "--cpu",
                         "--beam", "1", *MULTI_SOURCE_TASK, input="w1 w2\tW1 W2\n", check=False)
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert f"{field[-1]}=" in lines[-1] and REFUSED in lines[-1]
    with pytest.raises(UnsafeCheckpointError, match=f"{field[-1]}=.*{REFUSED}"):
        MultiSourceTransformerModel.from_pretrained(str(malicious.parent), malicious.name, str(corpora["n_way"]))
    assert not sentinel.exists()
