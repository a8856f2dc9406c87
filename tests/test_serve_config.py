"""`onegpu serve`'s settings before any model is loaded: the KV-cache plan (the budget's pool of
blocks, and what it holds) and bad flags, each refused with one error naming the flag."""

from __future__ import annotations

import pytest

from onegpu.cli.main import main
from onegpu.errors import ConfigError
from onegpu.infer.kv_budget import GiB, plan_kv

KIB = 1024


def test_the_pool_is_the_budget_in_blocks():
    # 1 KiB a position, 16 positions a block = 16 KiB a block; a 3.5 MiB budget holds 224 blocks:
    # 223 and the null block, 3 sequences of 1024 positions at worst (64 blocks each)
    plan = plan_kv(KIB, 2048, "cpu", max_len=1024, max_slots=8, kv_memory_gib=3.5 * 2**20 / GiB)
    assert (plan.max_len, plan.num_blocks, plan.block_size, plan.fits) == (1024, 224, 16, 3)
    assert plan.max_slots == 8  # rows are not lowered: short sequences take fewer blocks
    said = plan.describe()
    assert "holds 223 blocks of 16 positions" in said and "3 sequences of 1024 at worst" in said


def test_the_default_length_is_the_context_up_to_4096():
    assert plan_kv(KIB, 256, "cpu", kv_memory_gib=1).max_len == 256
    assert plan_kv(KIB, 131072, "cpu", kv_memory_gib=1).max_len == 4096


def test_a_sequence_that_does_not_fit_names_max_len_and_the_length_that_would():
    with pytest.raises(ConfigError) as raised:
        plan_kv(KIB, 8192, "cpu", max_len=4096, kv_memory_gib=2 * 2**20 / GiB)
    assert "--max_len 4096" in str(raised.value) and "--max_len to 2032 or less" in str(
        raised.value
    )
    with pytest.raises(ConfigError, match="over the model's context of 256"):
        plan_kv(KIB, 256, "cpu", max_len=512)


@pytest.mark.parametrize(
    "flags,named",
    [
        (["--adapter", "no-equals-sign"], "--adapter 'no-equals-sign' is not NAME=DIR"),
        (["--adapter", "a=/nonexistent/adapter"], "no adapter_config.json"),
        (["--max_slots", "0"], "--max_slots has an invalid value"),
        (["--api_key", " "], "--api_key is empty"),
    ],
)
def test_bad_flags_are_refused_before_loading(tiny_model_dir, capsys, flags, named):
    assert main(["serve", "--model", str(tiny_model_dir), *flags]) == 2
    assert named in capsys.readouterr().err


def test_an_adapter_named_as_the_base_is_refused(tiny_model_dir, tmp_path, capsys):
    (tmp_path / "adapter_config.json").write_text("{}")
    argv = ["serve", "--model", str(tiny_model_dir), "--served_name", "base"]
    assert main([*argv, "--adapter", f"base={tmp_path}"]) == 2
    assert "also the base model's name" in capsys.readouterr().err


def test_help_documents_every_server_flag_with_underscores(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = capsys.readouterr().out
    for flag in ("--host", "--port", "--api_key", "--adapter NAME=DIR", "--max_len", "--max_slots"):
        assert flag in text
    assert "--queue_size" in text and "--dtype" in text and "--merge_adapter" not in text
