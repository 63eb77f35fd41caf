"""fairseq-hydra-train: the models' options as dataclasses derived from their declarations,
the presets as the YAML configs of examples/hydra, and round trips that train with
fairseq-hydra-train, reload, decode and build the model that fairseq-train builds."""
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import fairseq
import pytest
from fairseq import checkpoint_utils, options, tasks
from fairseq.dataclass.initialize import hydra_init
from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_REGISTRY
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import mlmha_fairseq  # noqa: F401  (registers the models)
from fairseq_helpers import (
    TINY_MODEL_ARGS,
    USER_DIR,
    binarize_n_way,
    generate,
    hypotheses_and_references,
    write_n_way_text,
)
from mlmha_fairseq.cli.hydra_configs import preset_yaml
from mlmha_fairseq.errors import UsageError
from mlmha_fairseq.models.hydra_configs import (
    applied,
    model_config,
    namespace_of,
    option_actions,
    package_models,
    package_presets,
)
from mlmha_fairseq.models.multi_level_supervision import AIFStep
from mlmha_fairseq.models.multi_source import MultiSourceEncoder
from mlmha_fairseq.models.options import MECHANISMS
from mlmha_fairseq.models.slot_transformer import package_options
from mlmha_fairseq.modules.input_combination import InputCombination
from mlmha_fairseq.modules.multi_layer_attention import MultiLayerMultiheadAttention

CONFIG_DIR = Path(__file__).resolve().parent.parent / "examples" / "hydra"
PRESETS = package_presets()
SIZES = ("encoder_embed_dim", "encoder_ffn_embed_dim", "decoder_embed_dim")


# The one option whose default differs by model: the multi-source model takes the options of
# multi-level supervision with no auxiliary decoders by default (tests/test_composition.py).
MODEL_DEFAULTS = {"multi_source_transformer": {"aux_decoder_layers": "none"}}


def fields_of(model):
    return {field.name: field for field in dataclasses.fields(model_config(model))}


def resolved(arch, **overrides):
    """examples/hydra/model/<arch>.yaml as fairseq-hydra-train reads it (under ``model``,
    interpolations resolved), after ``model.<option>=<value>`` overrides."""
    cfg = OmegaConf.create({"model": OmegaConf.load(CONFIG_DIR / "model" / f"{arch}.yaml")})
    for key, value in overrides.items():
        cfg.model[key] = value
    return OmegaConf.to_container(cfg, resolve=True)["model"]


# --- the dataclasses --------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(package_models()))
def test_every_option_of_a_model_is_a_field_with_its_declared_help_and_default(name):
    model = package_models()[name]
    fields = fields_of(model)
    accepted = {action.dest for action in option_actions(model.add_args)}
    assert accepted <= set(fields)
    declared = [option for mechanism in MECHANISMS.values() for option in mechanism.options
                if option.dest in accepted]
    assert declared
    for option in declared:
        expected = MODEL_DEFAULTS.get(name, {}).get(option.dest, option.default)
        assert fields[option.dest].default == expected, option.flag
        assert fields[option.dest].metadata["help"] == option.help, option.flag


def test_every_declared_option_is_a_field_of_some_model():
    fields = set().union(*(fields_of(model) for model in package_models().values()))
    assert {option.dest for mechanism in MECHANISMS.values() for option in mechanism.options} <= fields


@pytest.mark.parametrize("name", sorted(package_models()))
def test_hydra_composes_every_option_of_a_model_at_its_default(name):
    """The ConfigStore entry: a program that imports the package selects the model with
    model=<name> and sees every option at the model's default (fairseq-train's)."""
    hydra_init()  # as fairseq-hydra-train (hydra 1.1 semantics): fairseq's config.yaml, FairseqConfig its schema
    with initialize_config_dir(version_base="1.1", config_dir=os.path.join(os.path.dirname(fairseq.__file__), "config")):
        cfg = compose(config_name="config", overrides=[f"model={name}"])
    expected = applied(package_models()[name].complete_options)
    composed = OmegaConf.to_container(cfg.model, enum_to_str=True)
    assert set(composed) == set(fields_of(package_models()[name]))
    assert composed["_name"] == name
    assert {key: composed[key] for key in expected} == expected


def test_a_hydra_model_config_with_an_unknown_or_mistyped_option_is_refused():
    model = package_models()["slot_transformer"]
    cfg = OmegaConf.create({"model": {"_name": "slot_transformer", "mlmha_varaint": "M-10"}})
    with pytest.raises(UsageError, match=r"^model.mlmha_varaint: not an option of SlotTransformerModel"):
        namespace_of(model, cfg.model)
    cfg = OmegaConf.create({"model": {"_name": "slot_transformer", "encoder_layers": "six"}})
    with pytest.raises(UsageError, match=r"^model.encoder_layers: Value 'six' .* could not be converted to Integer$"):
        namespace_of(model, cfg.model)
    cfg = OmegaConf.create({"model": {"_name": "slot_transformer", "mlmha_variant": "M-77"}})
    with pytest.raises(UsageError, match=r"^model.mlmha_variant: Invalid value 'M-77', expected one of \[M-00,"):
        namespace_of(model, cfg.model)


# --- the YAML configs -------------------------------------------------------------------

def test_the_shipped_preset_configs_are_what_the_generator_writes():
    assert sorted(path.stem for path in (CONFIG_DIR / "model").glob("*.yaml")) == sorted(PRESETS)
    for arch in PRESETS:
        assert (CONFIG_DIR / "model" / f"{arch}.yaml").read_text(encoding="utf-8") == preset_yaml(arch), \
            f"{arch}: run python -m mlmha_fairseq.cli.hydra_configs examples/hydra"


@pytest.mark.parametrize("arch", PRESETS)
def test_a_preset_config_holds_its_architecture_function_values(arch):
    config = resolved(arch)
    expected = applied(ARCH_CONFIG_REGISTRY[arch])
    fields = fields_of(ARCH_MODEL_REGISTRY[arch])
    assert config["_name"] == arch and set(config) == set(fields)
    assert set(expected) <= set(fields)  # fairseq applies the preset to a hydra config before the check
    for key, field in fields.items():
        if key != "_name":
            assert config[key] == expected.get(key, field.default), key


@pytest.mark.parametrize("arch", PRESETS)
def test_overriding_a_size_of_a_preset_config_changes_what_its_architecture_derives_from_it(arch):
    """model.encoder_embed_dim=7 gives the decoder the width fairseq-train's --encoder-embed-dim 7
    gives it: the interpolations follow the architecture function."""
    for size in SIZES:
        expected = applied(ARCH_CONFIG_REGISTRY[arch], **{size: 7})
        config = resolved(arch, **{size: 7})
        assert {key: config[key] for key in expected} == expected, size


# --- round trips ------------------------------------------------------------------------

def hydra_overrides(argv):
    """fairseq-train's model options (``--encoder-layers 3 ...``) as hydra overrides."""
    return [f"model.{flag[2:].replace('-', '_')}={value}" for flag, value in zip(argv[::2], argv[1::2])]


def hydra_train(config_name, data, save_dir, *overrides):
    """fairseq-hydra-train with a shipped config, a few updates of a tiny model on the CPU."""
    result = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "fairseq-hydra-train"),
         "--config-dir", str(CONFIG_DIR), "--config-name", config_name,
         f"task.data={data}", f"checkpoint.save_dir={save_dir}", "common.cpu=true", "common.seed=1",
         "optimization.max_update=3", "dataset.max_tokens=400", "dataset.num_workers=0",
         "common.log_interval=1", *hydra_overrides(TINY_MODEL_ARGS), *overrides],
        capture_output=True, text=True, cwd=save_dir.parent, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-4000:]
    checkpoint = save_dir / "checkpoint_last.pt"
    assert checkpoint.exists()
    return checkpoint


def assert_decodes_the_test_set(data, checkpoint, *options_):
    hypotheses, references = hypotheses_and_references(
        generate(data, checkpoint, "--required-batch-size-multiple", "1", *options_))
    assert len(hypotheses) == len(references) == 16


def reloaded(checkpoint):
    models, _cfg, _task = checkpoint_utils.load_model_ensemble_and_task([str(checkpoint)])
    return models[0]


def argparse_model(data, arch, *extra):
    """The model fairseq-train builds from the same preset and options."""
    args = options.parse_args_and_arch(options.get_training_parser(), [
        str(data), "--user-dir", USER_DIR, "--arch", arch, *TINY_MODEL_ARGS, *extra])
    return tasks.setup_task(args).build_model(args)


def assert_same_model(hydra, argparsed):
    assert {k: v.shape for k, v in hydra.state_dict().items()} == \
        {k: v.shape for k, v in argparsed.state_dict().items()}
    assert package_options(hydra.args) == package_options(argparsed.args)


def test_hydra_round_trip_slot_transformer_with_mlmha(data_bin, tmp_path):
    checkpoint = hydra_train("translation", data_bin, tmp_path / "ckpt", "model=mlmha_transformer_iwslt",
                             "model.mlmha_variant=M-10")
    model = reloaded(checkpoint)
    assert all(isinstance(layer.encoder_attn, MultiLayerMultiheadAttention) for layer in model.decoder.layers)
    assert_same_model(model, argparse_model(data_bin, "mlmha_transformer_iwslt", "--mlmha-variant", "M-10"))
    assert_decodes_the_test_set(data_bin, checkpoint)


def test_hydra_round_trip_multi_level_supervision_with_aif(data_bin, tmp_path):
    # ms_transformer_iwslt's auxiliary decoder sits on encoder layer 3 of its 4, computed from
    # the depth by the architecture function: a config holds the value, the 3-layer test model
    # names layer 1
    checkpoint = hydra_train("multi_level_supervision", data_bin, tmp_path / "ckpt", "model.aux_decoder_layers=1")
    model = reloaded(checkpoint)
    assert len(model.decoder.aux_decoders) == 1
    assert all(isinstance(layer.aux_fusion, AIFStep) for layer in model.decoder.layers)
    assert_same_model(model, argparse_model(data_bin, "ms_transformer_iwslt", "--aux-decoder-layers", "1",
                                            "--criterion", "multi_decoder_label_smoothed_cross_entropy"))
    assert_decodes_the_test_set(data_bin, checkpoint)


@pytest.fixture(scope="module")
def n_way_text_bin(tmp_path_factory):
    """Two text sources s1, s2 and the target tgt (fairseq_helpers.write_n_way_text), binarized."""
    root = tmp_path_factory.mktemp("n_way_text")
    write_n_way_text(root)
    binarize_n_way(root, root / "bin")
    return root / "bin"


@pytest.mark.cli  # on a binarized corpus, like the fixtures conftest.py marks
def test_hydra_round_trip_multi_source(n_way_text_bin, tmp_path):
    task = ["--task", "multi_source_translation", "--source-langs", "s1,s2", "--target-lang", "tgt"]
    checkpoint = hydra_train("multi_source_translation", n_way_text_bin, tmp_path / "ckpt",
                             "task.source_langs='s1,s2'", "task.target_lang=tgt",
                             "model.combination_strategy=parallel")
    model = reloaded(checkpoint)
    assert isinstance(model.encoder, MultiSourceEncoder) and len(model.encoder.encoders) == 2
    assert all(isinstance(layer.encoder_attn, InputCombination) for layer in model.decoder.layers)
    assert_same_model(model, argparse_model(n_way_text_bin, "multi_source_transformer_europarl", *task,
                                            "--combination-strategy", "parallel"))
    assert_decodes_the_test_set(n_way_text_bin, checkpoint, *task)
