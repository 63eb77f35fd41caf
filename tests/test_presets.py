"""Every preset against the table "Presets against the documents" of its example README
(examples/*/README.md): the table is parsed here, so it cannot drift from the code.

In the table's last column, `name=value` is checked against the preset's arguments (the
architecture function applied to an empty namespace) or, for `decoder_self_attention_bias`,
against a tiny model built with the preset; a `--flag` must appear in the README's recipe.
"""
import argparse
import ast
import re
from pathlib import Path

import pytest
import torch
from fairseq import checkpoint_utils, options
from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_REGISTRY

import mlmha_fairseq  # noqa: F401  (registers the architectures)
from fairseq_helpers import TINY_MODEL_ARGS, USER_DIR, build_model, full_logits, toy_dictionary
from fixtures.tiny_fairseq import write_data_bin
from mlmha_fairseq.models.multi_source import MultiSourceTransformerModel
from mlmha_fairseq.tasks.multi_source_translation import MultiSourceTranslationTask

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SECTION = "## Presets against the documents"
REQUIRED_SETTINGS = ("normalization", "dropout", "sharing", "biases")
MODEL_FACTS = ("decoder_self_attention_bias",)
ALL = "all"


def table_rows(text):
    """``(presets, setting, document, ours)`` of the section's table; ``all`` = every preset
    the table names."""
    body = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in body.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) != 4 or cells[0] == "preset" or set(cells[0]) <= {"-"}:
            continue
        rows.append(cells)
    named = sorted({name for cells in rows for name in re.findall(r"`([a-z0-9_]+)`", cells[0])})
    return [(named if cells[0] == ALL else re.findall(r"`([a-z0-9_]+)`", cells[0]), *cells[1:])
            for cells in rows]


def readme_tables():
    """``{preset: [(readme, setting, ours), ...]}`` over every example README."""
    presets = {}
    for readme in sorted(EXAMPLES.glob("*/README.md")):
        text = readme.read_text(encoding="utf-8")
        assert SECTION in text, f"{readme} has no '{SECTION}' table"
        for names, setting, _document, ours in table_rows(text):
            for name in names:
                presets.setdefault(name, []).append((readme, setting, ours))
    return presets


TABLES = readme_tables()
def preset_args(arch):
    args = argparse.Namespace()
    ARCH_CONFIG_REGISTRY[arch](args)
    return args


def tiny_model(arch):
    """The preset at tiny sizes (its other settings kept), on the toy dictionary."""
    if ARCH_MODEL_REGISTRY[arch] is not MultiSourceTransformerModel:
        return build_model(arch)
    args = options.parse_args_and_arch(options.get_training_parser(), [
        "unused-data-dir", "--task", "multi_source_translation", "--user-dir", USER_DIR,
        "--arch", arch, *TINY_MODEL_ARGS, "--source-langs", "a,b", "--target-lang", "tgt"])
    return MultiSourceTranslationTask(args, toy_dictionary(), {}).build_model(args)


def model_facts(arch):
    model = tiny_model(arch)
    return {"decoder_self_attention_bias": model.decoder.layers[0].self_attn.q_proj.bias is not None}


def test_every_preset_of_the_package_has_a_table():
    generic = {"slot_transformer", "ms_transformer", "multi_source_transformer"}
    presets = {arch for arch, model in ARCH_MODEL_REGISTRY.items()
               if model.__module__.startswith("mlmha_fairseq")} - generic
    assert presets - set(TABLES) == set()
    assert set(TABLES) - presets == set()  # no table names an architecture that does not exist


@pytest.mark.parametrize("arch", sorted(TABLES))
def test_preset_matches_its_readme_table(arch):
    rows = TABLES[arch]
    args, facts = preset_args(arch), None
    checked = {setting: 0 for setting in REQUIRED_SETTINGS}
    for readme, setting, ours in rows:
        for name, value in re.findall(r"`([a-z_0-9]+)=([^`]+)`", ours):
            if name in MODEL_FACTS:
                facts = facts or model_facts(arch)
                actual = facts[name]
            else:
                assert hasattr(args, name), f"{readme.parent.name}: {arch} has no argument {name}"
                actual = getattr(args, name)
            assert actual == ast.literal_eval(value), f"{readme.parent.name}: {arch} {setting}: {name}"
            checked[setting] = checked.get(setting, 0) + 1
        text = readme.read_text(encoding="utf-8")
        recipe = text.replace(text.split(SECTION, 1)[1].split("\n## ", 1)[0], "")
        for flag in re.findall(r"`(--[a-z-]+(?: [^`]+)?)`", ours):
            assert flag in recipe, f"{readme.parent.name}: {flag} of the table is not in the recipe"
    missing = [setting for setting in REQUIRED_SETTINGS if not checked[setting]]
    assert missing == [], f"{arch}: no checked value for {missing}"


# A tiny mlmha_transformer_iwslt checkpoint saved with the release whose preset was post-norm
# (tests/fixtures/tiny_fairseq.build_task_and_model(data, seed=3, extra_args=["--arch",
# "mlmha_transformer_iwslt"]) and save_checkpoint); its extra_state holds a batch
# (fairseq_helpers.random_batch(task.source_dictionary, seed=5)) and the logits it gave.
OLD_CHECKPOINT = Path(__file__).parent / "fixtures" / "mlmha_transformer_iwslt_before_pre_norm.pt"


def test_checkpoint_of_the_post_norm_preset_still_loads_as_post_norm(tmp_path):
    stored = torch.load(OLD_CHECKPOINT, weights_only=False)
    stored_args = stored["cfg"]["model"]  # the argparse namespace of the legacy architectures
    assert stored_args.arch == "mlmha_transformer_iwslt" and stored_args.encoder_normalize_before is False
    data = write_data_bin(str(tmp_path / "data-bin"))
    models, cfg, _task = checkpoint_utils.load_model_ensemble_and_task(
        [str(OLD_CHECKPOINT)], arg_overrides={"data": data})
    model = models[0].eval()
    assert not model.encoder.layers[0].normalize_before and model.encoder.layer_norm is None
    src, lengths, prev = stored["extra_state"]["test_batch"]
    with torch.no_grad():
        torch.testing.assert_close(full_logits(model, src, lengths, prev),
                                   stored["extra_state"]["test_logits"])
    # the preset itself now builds pre-norm layers (so the loaded model was not rebuilt)
    assert preset_args("mlmha_transformer_iwslt").encoder_normalize_before is True
