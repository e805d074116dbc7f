"""Fuzzed inputs: every reader of user files and settings gives a result or a clear error.

A clear error is ``RunRecordError`` (the run-record reader) or ``PacingConfigError`` (everything
else), both ``ValueError`` subclasses, whose message names the line, the field, the override, the
variable or the file: never a ``TypeError``/``KeyError``/YAML/omegaconf exception from deep inside.
Derandomized with a fixed number of examples, so a run is the same on every machine; ``make test``
runs half of each (``FUZZ_SCALE=0.5``: the suite's time budget), ``make unit`` all of them.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pace_strategy.apps.recipe_schema import TrainRecipe, load_recipe
from pace_strategy.core.config import PacingConfig
from pace_strategy.core.errors import PacingConfigError
from pace_strategy.integrations.accelerate.launch import prepare_launch
from pace_strategy.integrations.env import (
    NON_CONFIG_ENV,
    config_from_env,
    config_to_env,
    env_fields,
    env_name,
)
from pace_strategy.settings import build, load_mapping
from pace_strategy.sim.model import SimConfig
from pace_strategy.telemetry.run_record import (
    SCHEMA_VERSION,
    RunRecord,
    RunRecordError,
    read_run_record,
    summarize,
)

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "run4_transient.jsonl"


#: the share of each test's examples run (``make test``: 0.5)
SCALE = float(os.environ.get("FUZZ_SCALE", "1"))


def fuzz(examples: int) -> settings:
    return settings(
        max_examples=max(10, round(examples * SCALE)),
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # module scope: hypothesis reuses one function-scoped tmp_path across examples (and warns)
    return tmp_path_factory.mktemp("fuzz")


def test_both_errors_are_value_errors() -> None:
    assert issubclass(PacingConfigError, ValueError) and issubclass(RunRecordError, ValueError)


# ------------------------------------------------------------------------------------ JSON-ish values
def _scalars() -> st.SearchStrategy[Any]:
    return st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.integers(min_value=-(10**400), max_value=10**400),
        st.floats(),  # nan and +-inf included
        st.text(max_size=12),
    )


JSONISH = st.recursive(
    _scalars(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=8,
)


# --------------------------------------------------------------------------------------- run record
#: a small valid record: the fixture's header, its first windows and its end line
_LINES = FIXTURE.read_bytes().splitlines(keepends=True)
BASE_LINES = _LINES[:40] + _LINES[-1:]
BASE = b"".join(BASE_LINES)
BASE_KINDS = [json.loads(line)["record"] for line in BASE_LINES]


def _read(work: Path, data: bytes) -> RunRecord:
    path = work / "pace_run.jsonl"
    path.write_bytes(data)
    record = read_run_record(path)
    summarize(record)  # a record that reads is also one that the summary can use
    return record


def _named_line(message: str) -> int:
    found = re.search(r"\bline (\d+)\b|\blines 1-(\d+)\b", message)
    assert found, f"the error names no line: {message}"
    return int(found.group(1) or found.group(2))


def test_the_base_record_reads() -> None:
    assert BASE_KINDS[0] == "header" and BASE_KINDS[-1] == "end" and "decision" in BASE_KINDS


@fuzz(150)
@given(cut=st.integers(min_value=0, max_value=len(BASE)))
def test_a_record_cut_at_any_byte(work: Path, cut: int) -> None:
    data = BASE[:cut]
    *whole, last = data.split(b"\n")
    last_is_whole = last + b"\n" in BASE_LINES[len(whole) : len(whole) + 1]
    if not whole and not last_is_whole:  # the header itself is cut
        with pytest.raises(RunRecordError) as caught:
            _read(work, data)
        if cut == 0:
            assert "is empty" in str(caught.value)
        else:
            assert _named_line(str(caught.value)) == 1
        return
    record = _read(work, data)
    kinds = BASE_KINDS[: len(whole) + last_is_whole]
    assert len(record.steps) == kinds.count("step") and len(record.decisions) == kinds.count("decision")
    assert record.truncated == (bool(last) and not last_is_whole)
    assert (record.end is not None) == (kinds[-1] == "end")


@fuzz(60)
@given(order=st.permutations(range(len(BASE_LINES))))
def test_shuffled_lines(work: Path, order: list[int]) -> None:
    data = b"".join(BASE_LINES[i] for i in order)
    if order[0] != 0:
        with pytest.raises(RunRecordError, match=r"no 'pace_strategy/run-record' header on line 1"):
            _read(work, data)
        return
    record = _read(work, data)  # order within the body is the reader's caller's business
    assert len(record.steps) == BASE_KINDS.count("step") and record.end is not None


@fuzz(200)
@given(
    offset=st.integers(min_value=0, max_value=len(BASE)),
    garbage=st.binary(min_size=1, max_size=8) | st.sampled_from([b"\n", b"{}\n", b"[1]", b"\xff", b'"']),
    overwrite=st.booleans(),
)
def test_garbage_bytes_injected(work: Path, offset: int, garbage: bytes, overwrite: bool) -> None:
    data = BASE[:offset] + garbage + BASE[offset + (len(garbage) if overwrite else 0) :]
    first = BASE[:offset].count(b"\n") + 1  # the line the garbage lands on
    try:
        _read(work, data)
    except RunRecordError as error:
        named = _named_line(str(error))
        # a changed header (its world_size) can fail the next line; otherwise the garbage's own lines
        low, high = (1, 2 + garbage.count(b"\n")) if first == 1 else (first, first + garbage.count(b"\n"))
        assert low <= named <= high, (named, first, error)


def test_a_header_only_record_of_any_world_size_summarizes(work: Path) -> None:
    header = {**json.loads(BASE_LINES[0]), "world_size": 10**12}
    summary = summarize(_read(work, json.dumps(header).encode() + b"\n"))  # no list of 10**12 counts
    assert summary.world_size == 10**12 and summary.steps == 0


#: what a line from another schema, or an edited one, may look like
_MUTATION = st.one_of(
    st.tuples(st.just("drop"), st.integers(min_value=0)),
    st.tuples(st.just("set"), st.integers(min_value=0), JSONISH),
    st.tuples(st.just("rank"), st.integers(min_value=0), JSONISH),  # one of the per-rank lists
    st.tuples(st.just("version"), st.integers(min_value=-2, max_value=5)),
)


@fuzz(250)
@given(line=st.integers(min_value=0, max_value=len(BASE_LINES) - 1), mutation=_MUTATION)
def test_lines_with_missing_or_mistyped_fields(work: Path, line: int, mutation: tuple[Any, ...]) -> None:
    obj = json.loads(BASE_LINES[line])
    kind, *args = mutation
    if kind == "drop":
        del obj[sorted(obj)[args[0] % len(obj)]]
    elif kind == "set":
        obj[sorted(obj)[args[0] % len(obj)]] = args[1]
    elif kind == "rank":
        assume("ranks" in obj)
        obj["ranks"][sorted(obj["ranks"])[args[0] % len(obj["ranks"])]] = args[1]
    else:
        line, obj = 0, {**json.loads(BASE_LINES[0]), "version": args[0]}
    lines = list(BASE_LINES)
    lines[line] = json.dumps(obj).encode() + b"\n"
    try:
        _read(work, b"".join(lines))
    except RunRecordError as error:
        message = str(error)
        version = obj.get("version") if line == 0 else None
        if type(version) is int and version > SCHEMA_VERSION:
            assert f"schema version {version}" in message and "Upgrade pace_strategy" in message
            return
        # the header's world size is checked against the next step's per-rank lists
        assert _named_line(message) in ((1, 2) if line == 0 else (line + 1,)), message
    else:
        assert not (kind == "version" and args[0] > SCHEMA_VERSION)


# ------------------------------------------------------------------------- settings: dotlists, recipes
def _field_paths(cls: type, prefix: str = "") -> list[str]:
    import dataclasses
    import typing

    hints = typing.get_type_hints(cls)
    paths = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            paths += _field_paths(tp, f"{prefix}{f.name}.")
        else:
            paths.append(prefix + f.name)
    return paths


RECIPE_PATHS = _field_paths(TrainRecipe) + [f"pacing.{f}" for f in PacingConfig.field_names()]
SIM_PATHS = _field_paths(SimConfig)

_WORD = st.text(st.characters(codec="ascii", categories=("Ll", "Nd")) | st.just("_"), min_size=1, max_size=6)
_KEY = st.one_of(
    st.sampled_from(RECIPE_PATHS),
    st.lists(_WORD, min_size=1, max_size=3).map(".".join),
    st.sampled_from(["", ".", "a..b", "model.lr.x", "trainer[0]", "${x}"]),
)
_VALUE = st.one_of(
    st.sampled_from(["1", "0", "-1", "0.5", "2.5", "null", "true", "x", "[1,2]", "{a: 1}", "nan", ".inf"]),
    st.sampled_from(
        ["[1,", "{a", '"', "${x}", "${oc.env:PACE_FUZZ_UNSET}", "???", "'", "!!binary x", "1e999"]
    ),
    st.text(max_size=10),
)
_OVERRIDE = st.one_of(st.tuples(_KEY, _VALUE).map("=".join), st.text(max_size=12))


def _names_a_key(message: str, keys: list[str]) -> bool:
    """Whether ``message`` names one of ``keys``, or a dotted part of one, as a whole name (quoted, or
    before ``=``/``:``): ``model.: ...`` names a section, not the field."""
    for key in keys:
        if repr(key) in message:
            return True
        parts = re.sub(r"\[(\d+)\]", r".\1", key).split(".")  # omegaconf reads a[0] as a.0
        candidates = {key} | {".".join(parts[:i]) for i in range(1, len(parts) + 1)} | set(parts)
        for c in candidates - {""}:
            if re.search(rf"(^|[\s'.\[(]){re.escape(c)}($|['=:\[\s])", message):
                return True
    return False


@fuzz(250)
@given(overrides=st.lists(_OVERRIDE, max_size=4))
def test_recipe_dotlists(overrides: list[str]) -> None:
    try:
        recipe = load_recipe(None, overrides)
    except PacingConfigError as error:
        message = str(error)
        keys = [o.split("=", 1)[0] for o in overrides]
        assert any(repr(o) in message for o in overrides) or _names_a_key(message, keys), message
    else:
        assert isinstance(recipe, TrainRecipe)


def _nested(paths: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    """Mappings of (mostly valid) dotted paths to JSON-ish or plausible values, nested as YAML would be."""
    plausible = st.one_of(
        JSONISH, st.sampled_from([0, 1, 2, 8, 0.05, 0.5, 10.0, "monitor", "cpu", [4], None])
    )
    entry = st.tuples(st.sampled_from(paths) | _WORD, plausible)

    def nest(entries: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for path, value in entries:
            *parents, leaf = path.split(".")
            node = out
            for p in parents:
                child = node.get(p)
                node[p] = child if isinstance(child, dict) else {}
                node = node[p]
            node[leaf] = value
        return out

    return st.lists(entry, max_size=5).map(nest)


def _leaf_keys(values: Any, prefix: str = "") -> list[str]:
    if not isinstance(values, dict):
        return [prefix.rstrip(".")] if prefix else []
    keys = []
    for k, v in values.items():
        keys += [f"{prefix}{k}", *_leaf_keys(v, f"{prefix}{k}.")]
    return keys


@fuzz(200)
@given(values=_nested(RECIPE_PATHS))
def test_recipe_mappings(values: dict[str, Any]) -> None:
    try:
        recipe = build(TrainRecipe, values)
    except PacingConfigError as error:
        assert _names_a_key(str(error), _leaf_keys(values)), str(error)
    else:
        assert isinstance(recipe, TrainRecipe)


@fuzz(150)
@given(values=_nested(SIM_PATHS + [f"pacing.{f}" for f in PacingConfig.field_names()]))
def test_simulator_mappings(values: dict[str, Any]) -> None:
    try:
        config = build(SimConfig, values)
    except PacingConfigError as error:
        assert _names_a_key(str(error), _leaf_keys(values)), str(error)
    else:
        assert isinstance(config, SimConfig)


PACING_VALUES = st.dictionaries(
    st.sampled_from(PacingConfig.field_names()) | _WORD,
    st.one_of(JSONISH, st.sampled_from([0, 1, 3, 0.01, 0.2, 0.9, 20.0, "monitor", "forced", True, False])),
    max_size=4,
)


@fuzz(200)
@given(values=PACING_VALUES | JSONISH)
def test_pacing_config_from_any_mapping(values: Any) -> None:
    try:
        config = PacingConfig.from_dict(values)
    except PacingConfigError as error:
        message = str(error)
        assert not isinstance(values, dict) or _names_a_key(message, [str(k) for k in values]), message
    else:
        assert isinstance(config, PacingConfig) and PacingConfig.from_dict(config.to_dict()) == config


@fuzz(100)
@given(
    text=st.text(st.characters(exclude_categories=("Cs",)), max_size=40)
    | st.binary(max_size=40)
    | _nested(RECIPE_PATHS).map(lambda v: yaml.safe_dump(v, allow_unicode=True)),
    overrides=st.lists(_OVERRIDE, max_size=2),
)
def test_recipe_files_of_any_content(work: Path, text: str | bytes, overrides: list[str]) -> None:
    path = work / "recipe.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    try:
        values = load_mapping(path, overrides)
    except PacingConfigError as error:
        message = str(error)
        assert str(path) in message or any(repr(o) in message for o in overrides), message
        return
    assert isinstance(values, dict)
    try:
        build(TrainRecipe, values)
    except PacingConfigError as error:
        assert _names_a_key(str(error), _leaf_keys(values)), str(error)


# -------------------------------------------------------------------------------------- PACE_* variables
_ENV_NAME = st.one_of(
    st.sampled_from([env_name(f) for f in PacingConfig.field_names()]),
    st.sampled_from((*NON_CONFIG_ENV, "PACE_", "PACE_MAX_DELAY", "pace_gain", "HOME")),
    _WORD.map(lambda w: "PACE_" + w.upper()),
)
_ENV_VALUE = st.one_of(
    st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"), max_size=10),
    JSONISH.map(json.dumps),
    st.sampled_from(["1", "0", "true", "no", "monitor", "0.3", "20", "-1", "NaN", "[" * 3000]),
)


@fuzz(200)
@given(environ=st.dictionaries(_ENV_NAME, _ENV_VALUE, max_size=4))
def test_pace_environment(environ: dict[str, str]) -> None:
    config_names = [n for n in environ if n in env_fields()]  # the others: ignored with a warning
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = config_from_env(environ)
    except PacingConfigError as error:
        message = str(error)
        assert any(n in message for n in config_names), message
    else:
        assert (config is None) == (not config_names)


@fuzz(150)
@given(values=PACING_VALUES)
def test_config_to_env_round_trips(values: dict[str, Any]) -> None:
    try:
        expected = build(PacingConfig, values)
    except PacingConfigError:
        with pytest.raises(PacingConfigError):
            config_to_env(values)
        return
    assert config_from_env(config_to_env(values)) == (expected if values else None)


# --------------------------------------------------------------------------- the accelerate config file
_ACCELERATE = st.fixed_dictionaries(
    {},
    optional={
        "distributed_type": st.sampled_from(["MULTI_CPU", "MULTI_GPU", "NO"]) | JSONISH,
        "num_processes": st.sampled_from([1, 2, 4, "2", None]) | JSONISH,
        "num_machines": st.sampled_from([1, 2, 0, None]) | JSONISH,
        "mixed_precision": st.sampled_from(["no", "bf16"]),
        "pacing_config": st.none() | PACING_VALUES | JSONISH,
    },
)


@fuzz(150)
@given(
    content=_ACCELERATE.map(lambda d: yaml.safe_dump(d, allow_unicode=True))
    | st.text(st.characters(exclude_categories=("Cs",)), max_size=40)
    | st.binary(max_size=30)
)
def test_accelerate_config_files(work: Path, content: str | bytes) -> None:
    path = work / "accelerate.yaml"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    argv = ["--num_processes", "2", f"--config_file={path}", "train.py", "--lr", "1"]
    try:
        args, env, tmp = prepare_launch(argv)
    except PacingConfigError as error:
        assert str(path) in str(error), str(error)
        return
    if tmp is None:
        assert args == argv and env == {}
        return
    try:
        assert tmp.is_file() and args[2] == f"--config_file={tmp}" and env["PACE_CONFIG_SOURCE"] == str(path)
        cleaned = yaml.safe_load(tmp.read_text())
        assert "pacing_config" not in cleaned
        section = yaml.safe_load(path.read_text())["pacing_config"]
        config = config_from_env({k: v for k, v in env.items() if k.startswith("PACE_")})
        assert config == (build(PacingConfig, section) if section else None)
    finally:
        tmp.unlink()
