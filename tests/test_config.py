"""Config: YAML + command line generated from the dataclasses; clear errors for bad input."""

import pytest
import yaml

from onegpu.cli.args import make_parser, parse
from onegpu.cli.main import main
from onegpu.config import Config, from_dict, validate
from onegpu.errors import ConfigError


def _parse(argv):
    return parse(make_parser("onegpu train", "", Config), argv, Config)[0]


def _leaves(cls, prefix=""):
    """(dotted name, type, default) of every field of every section, nested ones (lora) included."""
    import dataclasses
    import typing

    from onegpu.config import sections

    hints = typing.get_type_hints(cls, vars(sections))
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _leaves(hints[f.name], f"{prefix}{f.name}.")
        else:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            yield f"{prefix}{f.name}", hints[f.name], default


STRINGS = {
    "output.report_to": "wandb",
    "techniques.compile_backend": "eager",
    "techniques.lora.targets": "q_proj",
}


def _other_value(name, t, default):
    """A valid value of the field's type that is not its default."""
    import typing

    if name in STRINGS:
        return STRINGS[name]
    if t is bool:
        return not default
    if t is int:
        return default + 1
    if t is float:
        return default + 0.5 if default < 0.4 else default / 2
    if t is str:
        return "x"
    args = typing.get_args(t)
    if typing.get_origin(t) is list:  # grpo.rewards, grpo.reward_weights: one element
        return [_other_value(name, args[0], 0.0 if args[0] is float else None)]
    if typing.get_origin(t) is typing.Literal:
        return next(a for a in args if a != default)
    for a in args:  # Optional[...] / Union[number, Literal["auto"]]
        if typing.get_origin(a) is list:
            return _other_value(name, a, None)
        if a in (int, float):
            return _other_value(name, a, default if isinstance(default, a) else 0)
        if a is bool:
            return True
        if a is str:
            return "x"
    raise AssertionError(f"no test value for {name}: {t}")


def test_every_field_is_a_flag():
    """Each field of each section, given on the command line with a value other than its default,
    lands in that field, or is refused by a check that names it (a value that needs another
    setting)."""
    fields = list(_leaves(Config))
    assert len(fields) >= 80 and "techniques.lora.r" in [f[0] for f in fields]
    parser, refused = make_parser("onegpu train", "", Config), []
    for name, t, default in fields:
        value = _other_value(name, t, default)
        if name == "output.tensorboard":  # the deprecated switch: folded into report_to
            value = False
        text = str(value).lower() if isinstance(value, bool) else str(value)
        section, _, key = name.rpartition(".")
        # a grpo.* field is GRPO's: set with that objective (alone it is refused, by name)
        extra = ["--training.objective", "grpo"] if section == "grpo" else []
        try:
            cfg = parse(parser, [*extra, f"--{name}", text], Config)[0]
        except ConfigError as exc:
            assert key in str(exc) + exc.hint, (name, str(exc))
            refused.append(name)
            continue
        holder = cfg
        for part in section.split(".") if section else ():
            holder = getattr(holder, part)
        if name == "output.tensorboard":
            assert (cfg.output.report_to, cfg.output.tensorboard) == ("none", None)
        else:
            assert getattr(holder, key) == value, name
    print("refused alone:", refused)
    # most fields take any valid value on their own; GRPO's group size (a divisor of the step's
    # completions), reference (needs beta > 0) and reward weights (one per reward) need another,
    # as do its tool settings: grpo.tools a real function, max_turns / tool_timeout / tool_parser
    # grpo.tools
    assert len(refused) <= 12, refused


def test_yaml_is_overridden_by_flags(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(
        yaml.safe_dump(
            {"training": {"lr": 0.5, "max_steps": 7}, "techniques": {"optimizer": "sgd"}}
        )
    )
    cfg = _parse(["--config", str(p), "--training.lr", "0.25", "--techniques.lora.r", "4"])
    assert isinstance(cfg, Config)
    assert (
        cfg.training.lr == 0.25
        and cfg.training.max_steps == 7
        and cfg.techniques.optimizer == "sgd"
    )
    assert cfg.techniques.lora.r == 4


def test_unknown_yaml_key_suggests_the_right_one(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("training:\n  lr: 0.1\n  max_step: 3\n")
    with pytest.raises(ConfigError, match="unknown config key 'training.max_step'") as e:
        _parse(["--config", str(p)])
    assert "did you mean 'training.max_steps'" in str(e.value)


def test_bad_yaml_names_the_line(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("training:\n  lr: 0.1\n   max_steps: [\n")
    with pytest.raises(ConfigError, match=r"c\.yaml line \d+: not valid YAML"):
        _parse(["--config", str(p)])


@pytest.mark.parametrize(
    "argv,expect",
    [
        (["--traning.lr", "1"], "did you mean '--training.lr'"),
        (["--techniques.optimizer", "adamw8"], "did you mean 'adamw'"),
        (["--techniques.precision", "fp8"], "techniques.precision: invalid value 'fp8'"),
        (
            ["--training.micro_batch_size", "0"],
            "training.micro_batch_size must be a positive integer",
        ),
        (["--training.lr", "-1"], "training.lr must not be negative"),
        (["--data.val_fraction", "1.5"], "data.val_fraction must be in"),
    ],
)
def test_bad_flags_give_one_clear_error(argv, expect, capsys):
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert expect in err and "Traceback" not in err


def test_unknown_command_suggests(capsys):
    assert main(["trian"]) == 2
    assert "did you mean 'onegpu train'" in capsys.readouterr().err


def test_wrong_types_in_dict_config():
    with pytest.raises(ConfigError, match="training.max_steps must be an integer"):
        from_dict({"training": {"max_steps": "many"}})
    with pytest.raises(ConfigError, match="techniques.tf32 must be true or false"):
        from_dict({"techniques": {"tf32": "yes"}})
    assert validate(from_dict({})).training.max_steps == Config().training.max_steps


@pytest.mark.parametrize(
    "flag,expect",
    [
        (
            "--training.learnig_rate",
            "--training.lr",
        ),  # a typo of another trainer's name: the alias, same section
        ("--training.learning_rate", "--training.lr"),
        ("--training.batch_size", "--training.micro_batch_size"),
        ("--training.seq_len", "--data.seq_len"),  # the right field in another section
        ("--data.max_seq_length", "--data.seq_len"),
        ("--traning.lr", "--training.lr"),
        ("--output.dri", "--output.dir"),
        ("--techniques.lora.rr", "--techniques.lora.r"),
    ],
)
def test_did_you_mean_prefers_the_same_section_and_known_aliases(flag, expect):
    with pytest.raises(ConfigError, match=f"did you mean '{expect}'"):
        _parse([flag, "1"])


def test_type_errors_say_the_type_in_words():
    for argv, expect in [
        (["--training.max_steps", "many"], "training.max_steps must be an integer, got 'many'"),
        (["--training.lr", "x"], "training.lr must be a number, got 'x'"),
        (["--techniques.tf32", "maybe"], "techniques.tf32 must be true or false, got 'maybe'"),
    ]:
        with pytest.raises(ConfigError, match=expect) as err:
            _parse(argv)
        assert "<class" not in str(err.value)


def test_model_flag_is_the_model_name(tmp_path):
    from onegpu.cli.train import model_shorthand

    assert _parse(model_shorthand(["--model", str(tmp_path)])).model.name == str(tmp_path)
    assert _parse(model_shorthand([f"--model={tmp_path}"])).model.name == str(tmp_path)
    section = tmp_path / "model.yaml"
    section.write_text("name: tiny\nvocab_size: 1024\n")
    cfg = _parse(model_shorthand(["--model", str(section)]))  # a section file keeps its meaning
    assert (cfg.model.name, cfg.model.vocab_size) == ("tiny", 1024)


def test_lr_help_names_the_auto_values_of_every_objective():
    """--help for training.lr gives what auto means for SFT and for the preference objectives
    (hyper.py's two tables), each number as the table has it."""
    import re

    from onegpu.hyper import _num, auto_table, preference_table

    text = " ".join(make_parser("onegpu train", "", Config).format_help().split())
    lr_help = re.search(r"--training\.lr \S+ (.*?) --training\.", text).group(1)
    for label, table in (("sft:", auto_table()), ("dpo/orpo/simpo:", preference_table())):
        part = lr_help.split(label, 1)[1].split(";")[0]
        assert [_num(table[mode]["lr"]) for mode in ("scratch", "full", "lora")] == re.findall(
            r"\d+e-\d+", part
        ), (label, part)


@pytest.mark.parametrize(
    "key,meant",
    [
        ("training.learning_rate", "training.lr"),  # another trainer's name
        ("training.lerning_rate", "training.lr"),
        ("techniques.lora.rank", "techniques.lora.r"),
        ("lr", "training.lr"),  # a field put at the top level
    ],
)
def test_a_misspelt_yaml_key_gets_the_did_you_mean_the_flag_gets(tmp_path, key, meant, capsys):
    """The same key as a flag and in a YAML file: one suggestion, not a list of valid keys."""
    *sections, name = key.split(".")
    doc: dict = {name: 1}
    for section in reversed(sections):
        doc = {section: doc}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError) as err:
        _parse(["--config", str(path)])
    assert err.value.hint == f"did you mean '{meant}'?"
    assert main(["train", f"--{key}", "1"]) == 2
    assert f"did you mean '--{meant}'" in capsys.readouterr().err


def test_a_list_flag_given_a_bare_name_says_a_list_is_expected():
    with pytest.raises(ConfigError, match=r"grpo.rewards takes a list, got 'length,format'") as err:
        _parse(["--grpo.rewards", "length,format"])
    assert "--grpo.rewards '[length, format]'" in err.value.hint
    ok = _parse(["--training.objective", "grpo", "--grpo.rewards", "[length, format]"])
    assert ok.grpo.rewards == ["length", "format"]
