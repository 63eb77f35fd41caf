"""Mechanism options: declared once (mlmha_fairseq.models.options), refused while their
mechanism is off, listed per preset by ``python -m mlmha_fairseq.cli.options``."""
import argparse
import json
import subprocess
import sys

import pytest
from fairseq import options
from fairseq.models import ARCH_CONFIG_REGISTRY

from fairseq_helpers import TINY_MODEL_ARGS, USER_DIR, build_model, toy_dictionary
from mlmha_fairseq.cli.options import list_options, package_archs
from mlmha_fairseq.errors import UsageError
from mlmha_fairseq.models import options as mechanism_options
from mlmha_fairseq.models.options import MECHANISMS, Mechanism, Option, Switch, check_options
from mlmha_fairseq.tasks.multi_source_translation import MultiSourceTranslationTask

# The model of each mechanism, and options that turn off what its default turns on.
MECHANISM_MODELS = {
    "MLMHA": ("slot_transformer", []),
    "layer aggregation": ("slot_transformer", []),
    "the collected encoder layers of MLMHA and layer aggregation": ("slot_transformer", []),
    "MMA": ("slot_transformer", []),
    "encoder without positions": ("slot_transformer", []),
    "the Dual Contextual module": ("slot_transformer", []),
    "MLRF": ("slot_transformer", []),
    "DLCL": ("slot_transformer", []),
    "multi-level supervision": ("ms_transformer", ["--aux-decoder-layers", "none"]),
    "the multi-source input combination": ("multi_source_transformer", []),
}


def set_value(option):
    """Command-line arguments that give ``option`` a value other than its default."""
    if option.is_flag:
        return [option.flag]
    choices = option.argparse.get("choices")
    if choices:
        return [option.flag, next(c for c in choices if c != option.default)]
    if option.argparse.get("type") in (int, float):
        return [option.flag, str((option.default or 1) + 1)]
    return [option.flag, {"--mma-heads": "G,L", "--mma-layers": "1", "--decode-from": "aux:1"}[option.flag]]


def build(arch, *extra):
    if arch != "multi_source_transformer":
        return build_model(arch, *extra)
    args = options.parse_args_and_arch(options.get_training_parser(), [
        "unused-data-dir", "--task", "multi_source_translation", "--user-dir", USER_DIR, "--arch", arch,
        *TINY_MODEL_ARGS, "--source-langs", "a,b", "--target-lang", "tgt", *extra])
    return MultiSourceTranslationTask(args, toy_dictionary(), {}).build_model(args)


CASES = [(mechanism, option) for mechanism in MECHANISMS.values() for option in mechanism.options
         if not option.is_switch]


def test_every_mechanism_has_a_model_here():
    assert set(MECHANISMS) == set(MECHANISM_MODELS)


def test_a_mechanism_is_registered_once_under_its_name(monkeypatch):
    monkeypatch.setattr(mechanism_options, "MECHANISMS", {})
    mechanism = Mechanism("test", None, ())
    assert mechanism_options.register_mechanism(mechanism) is mechanism
    assert mechanism_options.MECHANISMS == {"test": mechanism}
    with pytest.raises(ValueError, match="^mechanism 'test' registered twice$"):
        mechanism_options.register_mechanism(Mechanism("test", Switch("--other", bool), ()))
    assert mechanism_options.MECHANISMS["test"] is mechanism


def test_a_mechanism_without_a_switch_has_only_choices_and_options_with_switches_of_their_own():
    with pytest.raises(ValueError, match=r"^test: --test-size would be in effect with nothing to turn it on"):
        Mechanism("test", None, (Option("--test-choice", "a", "", is_switch=True), Option("--test-size", 1, "")))
    Mechanism("test", None, (Option("--test-size", 1, "", needs=Switch("--test-on", bool)),))


def test_a_negation_sets_its_flag_back_and_is_noted_as_typed():
    """``--no-aux-fusion`` after a preset's ``--aux-fusion``, declared with the option."""
    with pytest.raises(ValueError, match="only a flag has a negation"):
        Option("--test-size", 1, "", negation="--no-test-size")
    on = build_model("ms_transformer", "--aux-decoder-layers", "1", "--aux-fusion")
    off = build_model("ms_transformer", "--aux-decoder-layers", "1", "--aux-fusion", "--no-aux-fusion")
    assert on.args.aux_fusion is True and off.args.aux_fusion is False
    assert type(on.decoder.layers[0].aux_fusion).__name__ == "AIFStep"
    assert not hasattr(off.decoder.layers[0], "aux_fusion")
    with pytest.raises(UsageError, match=r"^--aux-fusion-dropout 0.5 needs --aux-fusion, which is off"):
        build_model("ms_transformer", "--aux-decoder-layers", "1", "--aux-fusion", "--no-aux-fusion",
                    "--aux-fusion-dropout", "0.5")


@pytest.mark.parametrize("mechanism, option", CASES, ids=[option.flag for _, option in CASES])
def test_an_option_set_while_its_mechanism_is_off_is_refused(mechanism, option):
    arch, off = MECHANISM_MODELS[mechanism.name]
    needs = option.needs or mechanism.switch
    with pytest.raises(UsageError) as error:
        build(arch, *off, *set_value(option))
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(option.flag) and f"needs {needs.text}" in message


# Options whose default a user can type (flags cannot be typed at their default False).
TYPED_AT_DEFAULT = [(mechanism, option) for mechanism, option in CASES
                    if option.default is not None and not option.is_flag]


@pytest.mark.parametrize("mechanism, option", TYPED_AT_DEFAULT, ids=[option.flag for _, option in TYPED_AT_DEFAULT])
def test_an_option_typed_at_its_default_while_its_mechanism_is_off_is_refused(mechanism, option):
    """Issue 26: ``--mlmha-variant M-00`` without ``--decoder-cross-attention multi-layer``
    trained a plain Transformer without a word, since only values other than the default were
    refused. What the user typed is refused whatever its value."""
    arch, off = MECHANISM_MODELS[mechanism.name]
    needs = option.needs or mechanism.switch
    with pytest.raises(UsageError) as error:
        build(arch, *off, option.flag, str(option.default))
    assert str(error.value).startswith(f"{option.flag} {option.default} needs {needs.text}, which is off")


def test_an_architecture_is_registered_with_fairseq_and_refuses_what_was_typed_while_off():
    """register_architecture, called here on a new name (at import time its calls run before
    any test): fairseq maps the name to the model and to a function that runs the preset,
    takes the typed-options note off the arguments and then checks it; the preset itself is
    returned unwrapped, for presets that call one another."""
    from fairseq.models import ARCH_MODEL_INV_REGISTRY, ARCH_MODEL_NAME_REGISTRY, ARCH_MODEL_REGISTRY, MODEL_REGISTRY

    name = "test_register_architecture_preset"

    def preset(args):  # the base architecture's defaults: MLMHA off
        args.preset_ran = True
        ARCH_CONFIG_REGISTRY["slot_transformer"](args)

    try:
        assert mechanism_options.register_architecture("slot_transformer", name)(preset) is preset
        assert ARCH_MODEL_REGISTRY[name] is MODEL_REGISTRY["slot_transformer"]
        assert ARCH_MODEL_NAME_REGISTRY[name] == "slot_transformer" and name in ARCH_MODEL_INV_REGISTRY["slot_transformer"]
        registered = ARCH_CONFIG_REGISTRY[name]
        args = argparse.Namespace(**{mechanism_options._TYPED: {}})
        registered(args)  # nothing typed: the preset runs, the note goes
        assert args.preset_ran and not hasattr(args, mechanism_options._TYPED)
        registered(argparse.Namespace())  # a checkpoint's arguments: no note at all
        typed = argparse.Namespace(**{mechanism_options._TYPED: {"mlmha_bias": "--mlmha-bias"}})
        with pytest.raises(UsageError, match="^--mlmha-bias needs"):
            registered(typed)  # typed while MLMHA is off (the preset's defaults): refused
    finally:
        for registry in (ARCH_MODEL_REGISTRY, ARCH_MODEL_NAME_REGISTRY, ARCH_CONFIG_REGISTRY):
            registry.pop(name, None)
        if name in ARCH_MODEL_INV_REGISTRY["slot_transformer"]:
            ARCH_MODEL_INV_REGISTRY["slot_transformer"].remove(name)


def test_every_typed_option_is_noted_not_only_the_last():
    """Two options of a mechanism that is off, both typed at their defaults: the first one
    declared is refused, so the note kept the earlier one when the later one was typed."""
    mechanism = next(m for m in MECHANISMS.values() if sum(m is n for n, _ in TYPED_AT_DEFAULT) >= 2)
    first, second = [option for m, option in TYPED_AT_DEFAULT if m is mechanism][:2]
    arch, off = MECHANISM_MODELS[mechanism.name]
    with pytest.raises(UsageError) as error:
        build(arch, *off, first.flag, str(first.default), second.flag, str(second.default))
    assert str(error.value).startswith(f"{first.flag} {first.default} needs")


@pytest.mark.parametrize("mechanism, option", TYPED_AT_DEFAULT[:1], ids=[TYPED_AT_DEFAULT[0][1].flag])
def test_an_option_set_without_a_command_line_is_refused_under_its_flag(mechanism, option):
    """Arguments made without fairseq's parser (a script, a hydra config turned into a
    Namespace) record nothing as typed: the message names the option by its flag."""
    args = argparse.Namespace()
    mechanism.set_defaults(args)
    _, value = set_value(option)
    setattr(args, option.dest, option.argparse.get("type", str)(value))
    with pytest.raises(UsageError) as error:
        mechanism.check(args)
    assert str(error.value).startswith(f"{option.flag} {getattr(args, option.dest)} needs")


def test_a_typed_option_is_named_as_typed_and_the_note_never_reaches_the_model_arguments():
    with pytest.raises(UsageError, match=r"^--mask-encoder-layer-mode zero needs --mlmha-mask-encoder-layer"):
        build_model("slot_transformer", "--layer-aggregation", "s-agg", "--mask-encoder-layer-mode", "zero")
    args = options.parse_args_and_arch(options.get_training_parser(), [
        "unused-data-dir", "--user-dir", USER_DIR, "--arch", "slot_transformer", *TINY_MODEL_ARGS,
        "--decoder-cross-attention", "multi-layer", "--mlmha-variant", "M-00", "--mlmha-bias"])
    assert args.mlmha_variant == "M-00" and args.mlmha_bias is True
    assert not [name for name in vars(args) if name.startswith("_mlmha")]  # nothing extra in a checkpoint


@pytest.mark.parametrize("arch, extra, option, value, module", [
    # the preset sets --mlmha-variant M-10: not typed
    ("mlmha_transformer_wmt_en_de", [], "mlmha_variant", "M-10", "MultiLayerMultiheadAttention"),
    # typed, turned on by the preset
    ("mlmha_transformer_iwslt", ["--mlmha-variant", "M-00"], "mlmha_variant", "M-00", "MultiLayerMultiheadAttention"),
    ("layer_aggregation_transformer_iwslt", ["--mlmha-top-n", "2"], "mlmha_top_n", 2, "IterativeAggregation"),
    ("mma_transformer_iwslt_de_en", ["--mma-local-window", "1"], "mma_local_window", 1, "MixedMultiheadAttention"),
])
def test_what_a_preset_sets_or_turns_on_is_not_refused(arch, extra, option, value, module):
    model = build_model(arch, *extra)
    assert getattr(model.args, option) == value
    assert module in {type(m).__name__ for m in model.modules()}  # the mechanism is on, not only parsed


def test_a_typed_option_whose_mechanism_a_preset_turns_on_is_refused_once_the_user_turns_it_off():
    with pytest.raises(UsageError, match=r"^--mlmha-variant M-00 needs --decoder-cross-attention multi-layer"):
        build_model("mlmha_transformer_iwslt", "--decoder-cross-attention", "standard", "--mlmha-variant", "M-00")


@pytest.mark.parametrize("extra, message", [
    (["--mlmha-top-n", "2"], "--mlmha-top-n 2 needs --decoder-cross-attention multi-layer or --layer-aggregation"),
    (["--layer-aggregation", "transparent", "--mlmha-mask-encoder-layer", "2"], "--mlmha-mask-encoder-layer 2 needs"),
    (["--mma-heads", "G,L"], "--mma-heads G,L needs --encoder-self-attention mixed"),
    (["--mma-local-window", "3"], "--mma-local-window 3 needs --encoder-self-attention mixed"),
    (["--mlrf-decoder-fusion", "fnn", "--mlrf-hops", "2"], "--mlrf-hops 2 needs SA fusion"),
    (["--mlrf-encoder-fusion", "avg", "--mlrf-indep-w1"], "--mlrf-indep-w1 needs SA fusion"),
    (["--decoder-cross-attention", "multi-layer", "--mlmha-top-n", "0"], "--mlmha-top-n 0 needs 1 <= n <= 3"),
    (["--layer-aggregation", "s-agg", "--top-encoder-layers", "0"], "--mlmha-top-n 0 needs 1 <= n <= 3"),
])
def test_the_options_that_were_silently_ignored(extra, message):
    with pytest.raises(UsageError, match=message):
        build_model("slot_transformer", *extra)


def test_empty_aux_decoder_layers_are_refused():
    with pytest.raises(UsageError, match="--aux-decoder-layers '': give the encoder layers"):
        build_model("ms_transformer", "--aux-decoder-layers", "")


def test_new_spellings_set_the_shared_options():
    model = build_model("slot_transformer", "--layer-aggregation", "s-agg", "--top-encoder-layers", "2",
                        "--mask-encoder-layer", "3")
    collector = model.encoder.memories["layer_aggregation"].collector
    assert collector.num_taps == 2 and collector.zeroed_layer == 3


@pytest.mark.parametrize("arch", package_archs())
def test_presets_set_no_option_of_a_mechanism_they_leave_off(arch):
    args = argparse.Namespace()
    ARCH_CONFIG_REGISTRY[arch](args)
    check_options(args)


def test_decoder_self_attention_stays_parseable_but_is_not_offered():
    model = build_model("slot_transformer", "--decoder-self-attention", "standard")
    assert type(model.decoder.layers[0].self_attn).__name__ == "MultiheadAttention"
    assert "--decoder-self-attention" not in {row["option"] for row in list_options("slot_transformer")}


def test_option_listing_shows_the_preset_defaults():
    rows = {row["dest"]: row for row in list_options("mlmha_transformer_iwslt")}
    assert rows["mlmha_top_n"]["default"] == 4
    assert rows["mlmha_top_n"]["option"] == "--mlmha-top-n, --top-encoder-layers"
    assert rows["decoder_cross_attention"]["default"] == "multi-layer"
    assert rows["mlmha_variant"]["mechanism"] == "MLMHA"
    assert "encoder_layers" not in rows  # fairseq's own options are left out
    wmt = {row["dest"]: row for row in list_options("mlmha_transformer_wmt_en_de")}
    assert wmt["mlmha_top_n"]["default"] == 6 and wmt["mlmha_variant"]["default"] == "M-10"
    ms = {row["option"]: row for row in list_options("ms_transformer_iwslt")}
    assert ms["--aux-decoder-layers"]["default"] == "3" and ms["--aux-fusion"]["default"] is True
    assert ms["--no-aux-fusion"]["default"] is False  # the flag is not given


def test_option_listing_command_line():
    result = subprocess.run([sys.executable, "-m", "mlmha_fairseq.cli.options", "--arch",
                             "mlmha_transformer_iwslt", "--format", "json"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    rows = {row["dest"]: row for row in json.loads(result.stdout)}
    assert rows["mlmha_top_n"]["default"] == 4
    result = subprocess.run([sys.executable, "-m", "mlmha_fairseq.cli.options", "--arch", "nope"],
                            capture_output=True, text=True)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].endswith("--arch nope: not an architecture of this "
                                                          "package; choose one of " + ", ".join(package_archs()))


@pytest.mark.parametrize("arch, extra, mechanisms", [
    ("slot_transformer", ["--encoder-self-attention", "mixed", "--dc-decoder-layers", "all",
                          "--decoder-cross-attention", "multi-layer", "--mlrf-decoder-fusion", "sa"],
     {"MMA": 1, "the Dual Contextual module": 1, "the collected encoder layers of MLMHA and layer aggregation": 1,
      "MLRF": 1}),
    ("ms_transformer", ["--aux-decoder-layers", "1,2", "--aux-fusion"], {"multi-level supervision": 1}),
    ("slot_transformer", ["--dlcl-encoder"], {"DLCL": 1}),
])
def test_each_mechanism_parses_its_options_once_per_model(arch, extra, mechanisms):
    """Every layer's filler asks for the options; they are parsed and validated once."""
    calls = []
    originals = {name: MECHANISMS[name].parse for name in mechanisms}

    def counting(name):
        return lambda cfg: calls.append(name) or originals[name](cfg)

    try:
        for name in mechanisms:  # the declarations are frozen: replace the parse function for this test
            object.__setattr__(MECHANISMS[name], "parse", counting(name))
        build(arch, *extra)
        build(arch, *extra)
    finally:
        for name, parse in originals.items():
            object.__setattr__(MECHANISMS[name], "parse", parse)
    assert {name: calls.count(name) for name in mechanisms} == {name: 2 * n for name, n in mechanisms.items()}


def test_the_slot_architecture_completes_missing_options_with_their_declared_defaults():
    """``slot_transformer`` on arguments that lack every option (a checkpoint of an older
    version): every selectable slot at ``standard`` and every slot-wide option at the default
    written in its declaration; options already given are kept."""
    args = argparse.Namespace(decoder_cross_attention="multi-layer", mlmha_top_n=2)
    ARCH_CONFIG_REGISTRY["slot_transformer"](args)
    assert args.encoder_self_attention == "standard" and not hasattr(args, "decoder_self_attention")
    assert args.decoder_cross_attention == "multi-layer" and args.mlmha_top_n == 2
    declared = {option.dest: option.default for mechanism in MECHANISMS.values() if mechanism.slot_wide
                for option in mechanism.options if option.dest != "mlmha_top_n"}
    assert "mlmha_variant" in declared and "aux_decoder_layers" not in declared
    assert {dest: getattr(args, dest) for dest in declared} == declared


def test_a_slot_choice_outside_the_registered_fillers_is_refused_by_the_parser(capsys):
    """A slot option accepts ``standard`` and its registered fillers only: a misspelt
    mechanism is an argparse error, not silently fairseq's module."""
    parser = options.get_training_parser()
    with pytest.raises(SystemExit):
        options.parse_args_and_arch(parser, ["unused-data-dir", "--user-dir", USER_DIR, "--arch", "slot_transformer",
                                             "--decoder-cross-attention", "multi_layer"])
    assert "--decoder-cross-attention: invalid choice: 'multi_layer'" in capsys.readouterr().err
