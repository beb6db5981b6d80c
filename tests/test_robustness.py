"""Bad input never escapes as a traceback: random strings through the parsers and the CLI."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckplan.cli import main
from ckplan.inputs.presets import load_spec
from ckplan.model.spec import SpecError, field_names, spec_from_mapping
from ckplan.plan import StrategyError, parse_strategy
from ckplan.units import SizeError, parse_size

text = st.text(max_size=20)
values = st.one_of(
    text,
    st.integers(-(10**12), 10**12),
    st.floats(allow_nan=True),
    st.booleans(),
    st.none(),
    st.lists(st.integers(), max_size=3),
)


@given(text)
def test_parse_size_accepts_or_raises_size_error(value):
    try:
        assert parse_size(value) >= 0
    except SizeError as error:
        assert "\n" not in str(error)


@given(st.sampled_from(field_names()), values)
@settings(max_examples=300)
def test_any_value_for_any_key_is_a_spec_or_a_one_line_error(key, value):
    base = load_spec("gpt2").to_dict()
    try:
        spec_from_mapping({**base, key: value})
    except SpecError as error:
        assert "\n" not in str(error) and (key in str(error) or "heads" in str(error))


@given(text)
def test_strategy_parser_never_crashes(value):
    try:
        parse_strategy(value, load_spec("gpt2"))
    except StrategyError as error:
        assert "\n" not in str(error)


@given(
    st.sampled_from(["seq", "layers", "heads", "micro_batch", "dropout", "norm", "tp", "nosuch"]),
    st.text(alphabet="0123456789-.abcxyz", max_size=6),
)
@settings(
    max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None
)
def test_cli_set_values_exit_cleanly(capsys, key, value):
    code = main(["estimate", "gpt2", "--set", f"{key}={value}", "--json"])
    out, err = capsys.readouterr()
    assert code in (0, 2)
    if code == 2:
        assert len(err.strip().splitlines()) == 1 and out == ""


@pytest.mark.parametrize("budget", ["", " ", "GB", "1e", "1e400GB", "0x10GB", "١٢GB", "nan", "inf"])
def test_odd_budgets_exit_2(capsys, budget):
    code = main(["sweep", "gpt2", "--budget", budget])
    _, err = capsys.readouterr()
    assert code == 2 and len(err.strip().splitlines()) == 1
