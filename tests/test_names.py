"""The run and component name grammar, steps, RUN@STEP, and printing names safely."""

from __future__ import annotations

import unicodedata

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckptstore.errors import ConfigError
from ckptstore.names import (
    MAX_STEP,
    check_component_name,
    check_kind,
    check_run_name,
    check_step,
    parse_step_id,
    parse_target,
    printable,
)


@pytest.mark.parametrize(
    "name", ["grpo-7b", "base-d60333723fab", "run.2026-12-01", "team/exp 3", "résumé", "a" * 255]
)
def test_run_names_people_use_are_accepted(name: str) -> None:
    assert check_run_name(name) == name


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("", "1-255"),
        ("a" * 256, "1-255"),
        ("with\x00nul", "U+0000"),
        ("\x1b[31mred", "U+001B"),
        ("line\nbreak", "U+000A"),
        ("bidi\u202eevil", "U+202E"),
        ("zero\u200bwidth", "U+200B"),
        ("a@b", "RUN@STEP"),
        (" padded", "whitespace"),
        ("padded\t", "U+0009"),
    ],
)
def test_run_names_that_break_the_cli_or_the_terminal_are_refused(name: str, why: str) -> None:
    with pytest.raises(ConfigError, match="run name") as excinfo:
        check_run_name(name)
    assert why in str(excinfo.value)
    assert "\x1b" not in str(excinfo.value)
    assert "\n" not in str(excinfo.value)


def test_a_run_name_must_be_a_string() -> None:
    with pytest.raises(ConfigError, match="string"):
        check_run_name(3)


@pytest.mark.parametrize(
    "name", ["policy", "policy/rank3", "optimizer/shard-0", "replay_buffer/g.12", "a:b=c,d+e"]
)
def test_component_names_are_accepted(name: str) -> None:
    assert check_component_name(name) == name


@pytest.mark.parametrize(
    "name",
    [
        "策略/秩3",  # CJK
        "política/rango-3",  # a precomposed accent
        "модель/ранг_1",  # Cyrillic
        "نموذج/رتبة١",  # Arabic, an Arabic-Indic digit
        "नीति/रैंक3",  # Devanagari: vowel signs and virama are combining marks after a letter
        "นโยบาย/อันดับ3",  # Thai
        "é",  # precomposed (NFC and NFKC)
    ],
)
def test_component_names_in_any_script_are_accepted(name: str) -> None:
    assert check_component_name(name) == name


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("\uff50\uff4f\uff4c\uff49\uff43\uff59", "NFKC"),  # fullwidth "policy"
        ("rank\u00b2", "NFKC"),  # superscript two
        ("\ufb01le", "NFKC"),  # the ligature fi
        ("e\u0301", "NFKC"),  # e + combining acute: looks like the NFC one, is another name
        ("\u2168", "NFKC"),  # ROMAN NUMERAL NINE
        ("\u0301x", "segments"),  # a combining mark with nothing to combine with
        ("a/\u0301", "segments"),
        ("a\u20ddb", "segments"),  # an enclosing mark draws over its neighbours
        ("pol\u202eicy", "segments"),  # bidi override
        ("a\u200db", "segments"),  # zero-width joiner
        ("a\u00a0b", "segments"),  # no-break space
        ("a\u3000b", "segments"),  # ideographic space
        ("a\u2044b", "segments"),  # fraction slash
        ("a\uff0fb", "segments"),  # fullwidth solidus
        ("a\u2215b", "segments"),  # division slash
        ("策略/../x", "segments"),
        ("策略\\x", "segments"),
        ("a\x1b[31m", "segments"),
    ],
)
def test_component_names_that_pass_for_others_or_move_the_cursor_are_refused(
    name: str, why: str
) -> None:
    with pytest.raises(ConfigError, match="invalid component name") as caught:
        check_component_name(name)
    message = str(caught.value)
    assert why in message
    assert message.isprintable(), message
    if why == "NFKC":
        assert repr(unicodedata.normalize("NFKC", name)) in message


@pytest.mark.parametrize(
    "name",
    [
        "",
        "policy/",
        "/policy",
        "../x",
        "a/../b",
        "a/./b",
        ".",
        "..",
        "a//b",
        "sp ace",
        "x\x00",
        "a" * 256,
        "back\\slash",
        "a@b",
    ],
)
def test_component_names_that_are_not_safe_paths_are_refused(name: str) -> None:
    with pytest.raises(ConfigError, match="invalid component name"):
        check_component_name(name)


@pytest.mark.parametrize("step", [0, 1, 10**12, MAX_STEP])
def test_steps_in_range(step: int) -> None:
    assert check_step(step) == step


@pytest.mark.parametrize("step", [-1, MAX_STEP + 1, 2**70, "3", 3.0, True, None])
def test_steps_out_of_range_or_not_ints_are_config_errors(step: object) -> None:
    with pytest.raises(ConfigError, match="step"):
        check_step(step)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("run", ("run", None)),
        ("run@12", ("run", 12)),
        ("a@b@3", ("a@b", 3)),
        (f"r@{MAX_STEP}", ("r", MAX_STEP)),
    ],
)
def test_parse_target(text: str, expected: tuple[str, int | None]) -> None:
    assert parse_target(text) == expected


@pytest.mark.parametrize(
    "text", ["run@", "@3", "run@-1", "run@1.5", "run@١٢", "run@²", f"run@{MAX_STEP + 1}", "r@ 3"]
)
def test_parse_target_refuses_what_is_not_an_int64_step(text: str) -> None:
    with pytest.raises(ConfigError, match="RUN@STEP"):
        parse_target(text)


def test_printable_escapes_control_and_invisible_characters() -> None:
    assert printable("plain name") == "plain name"
    assert printable("\x1b[31mred\x1b[0m") == "\\x1b[31mred\\x1b[0m"
    assert printable("a\u202eb") == "a\\u202eb"
    assert printable("tab\there") == "tab\\x09here"
    assert printable("back\\slash\x00") == "back\\\\slash\\x00"


@given(st.text())
def test_printable_output_has_nothing_a_terminal_interprets(text: str) -> None:
    shown = printable(text)
    assert all(ch == " " or ch.isprintable() for ch in shown)


@pytest.mark.parametrize("kind", ["state", "policy", "optimizer", "replay_buffer", "x" * 32])
def test_component_kinds(kind: str) -> None:
    assert check_kind(kind) == kind


@pytest.mark.parametrize("kind", ["", "Policy", "x" * 33, "has space", "1st", None, "a-b"])
def test_bad_component_kinds_are_refused(kind: object) -> None:
    with pytest.raises(ConfigError, match="invalid component kind"):
        check_kind(kind)


@pytest.mark.parametrize(
    ("value", "step"),
    [
        (30, 30),
        ("30", 30),
        ("step-30", 30),
        ("ckpt/step-30", 30),
        ("/abs/dump/checkpoint/step-7/", 7),
        ("s3://bucket/run/step-0", 0),
        ("gs://b/x/step-007", 7),
        (f"step-{MAX_STEP}", MAX_STEP),
    ],
)
def test_step_ids_as_torchtitan_names_checkpoints(value: object, step: int) -> None:
    assert parse_step_id(value) == step


@pytest.mark.parametrize(
    "value",
    [
        "ckpt/step-30/extra",
        "ckpt/30",
        "step-",
        "step--1",
        "step-1.5",
        " step-3",
        "step-3 ",
        "ckpt/step-٣",
        "step-" + "9" * 5000,
        f"step-{MAX_STEP + 1}",
        MAX_STEP + 1,
        -1,
        True,
        3.0,
        None,
        "",
    ],
)
def test_step_ids_that_name_no_step_are_refused_with_the_forms(value: object) -> None:
    with pytest.raises(ConfigError, match="checkpoint_id=") as caught:
        parse_step_id(value)
    message = str(caught.value)
    assert "step-N" in message
    assert len(message) < 300


def test_a_step_id_error_names_the_option_it_came_from() -> None:
    with pytest.raises(ConfigError, match=r"^checkpoint.load_step='ckpt/x'"):
        parse_step_id("ckpt/x", what="checkpoint.load_step")


@pytest.mark.parametrize(
    "name",
    ["", ".", "..", "a/..", "../a", "a/./b", "a//b", "/a", "a/", "a\n", "a b", "a\\b", "x" * 256],
)
def test_ascii_component_names_that_break_a_rule_are_refused(name: str) -> None:
    with pytest.raises(ConfigError, match="invalid component name"):
        check_component_name(name)


def _by_the_rules(name: str) -> bool:
    """The component-name rules for an ASCII name, spelled out one by one."""
    allowed = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._+=:,-")
    segments = name.split("/")
    return (
        0 < len(name) <= 255
        and all(segments)
        and all(s not in (".", "..") for s in segments)
        and all(ch in allowed for s in segments for ch in s)
    )


@given(st.text(alphabet="aZ9._+=:,-/ \n@", max_size=12))
def test_the_ascii_fast_path_agrees_with_the_rules(name: str) -> None:
    """ASCII names take one regular expression (a commit of 16,384 ranks checks 16,384 names);
    it accepts exactly what the rules accept."""
    try:
        check_component_name(name)
    except ConfigError:
        accepted = False
    else:
        accepted = True
    assert accepted == _by_the_rules(name)
