"""Every training recipe loads into the typed config; overrides and bad keys behave."""

from __future__ import annotations

from pathlib import Path

import pytest

from pace_strategy.apps.recipe_schema import TrainRecipe, load_recipe
from pace_strategy.core.errors import PacingConfigError

RECIPES = sorted((Path(__file__).resolve().parents[2] / "recipes" / "train").glob("*.yaml"))
# accelerate configs live beside the recipes but are accelerate's format, read by `pace launch`
TRAIN_RECIPES = [p for p in RECIPES if not p.name.endswith("_cpu.yaml")]


def test_the_three_recipes_of_the_docs_exist():
    names = {p.stem for p in TRAIN_RECIPES}
    assert {"lightning_ddp", "lightning_fsdp", "accelerate_ddp"} <= names


@pytest.mark.parametrize("path", TRAIN_RECIPES, ids=lambda p: p.stem)
def test_every_recipe_loads(path):
    recipe = load_recipe(path)
    assert isinstance(recipe, TrainRecipe)
    assert recipe.output.name == path.stem
    assert recipe.straggler.injection() is not None  # each recipe shows a straggler by default
    assert recipe.paced
    if recipe.pacing:
        assert recipe.pacing_config() is not None
    # the GPU form is an override away
    gpu = load_recipe(path, ["trainer.accelerator=gpu", "trainer.devices=8", "model.compute_ms=0"])
    assert (gpu.trainer.accelerator, gpu.trainer.devices, gpu.model.compute_ms) == ("gpu", 8, 0.0)


def test_fsdp_recipe_is_sharded_and_ddp_is_not():
    by_name = {p.stem: load_recipe(p) for p in TRAIN_RECIPES}
    assert by_name["lightning_fsdp"].sharded and not by_name["lightning_ddp"].sharded
    assert load_recipe(TRAIN_RECIPES[0], ["pacing=null", "trainer.strategy=ddp"]).pacing_config() is None


def test_unknown_keys_name_the_path_and_suggest(tmp_path):
    with pytest.raises(PacingConfigError, match=r"trainer\.max_step.*Did you mean 'trainer.max_steps'"):
        load_recipe(None, ["trainer.max_step=5"])
    with pytest.raises(PacingConfigError, match=r"pacing\.max_delay.*Did you mean 'pacing.max_delay_ms'"):
        load_recipe(None, ["pacing.max_delay=5"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("framework: lightning\nstragler:\n  rank: 1\n")
    with pytest.raises(PacingConfigError, match=r"bad\.yaml.*Did you mean 'straggler'"):
        load_recipe(bad)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.strategy=deepspeed", "trainer.strategy='deepspeed' is invalid"),
        ("trainer.devices=0", "trainer.devices=0 is invalid"),
        ("pacing.max_delay_ms=-1", "max_delay_ms=-1"),
        ("straggler.probability=2", "probability=2"),
        ("framework=keras", "framework='keras' is invalid"),
    ],
)
def test_bad_values_fail_at_load_naming_the_field(override, message):
    with pytest.raises(PacingConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        load_recipe(None, [override])


def test_accelerate_recipes_reject_lightning_only_strategies():
    with pytest.raises(PacingConfigError, match="framework=accelerate"):
        load_recipe(None, ["framework=accelerate", "trainer.strategy=paced_fsdp"])


def test_every_recipe_field_is_documented():
    import dataclasses

    docs = (Path(__file__).resolve().parents[2] / "docs" / "recipes.md").read_text()
    for top in dataclasses.fields(TrainRecipe):
        if dataclasses.is_dataclass(top.default_factory):  # type: ignore[arg-type]
            for sub in dataclasses.fields(top.default_factory):  # type: ignore[arg-type]
                assert f"`{top.name}.{sub.name}`" in docs, (
                    f"{top.name}.{sub.name} missing from docs/recipes.md"
                )
        else:
            assert f"`{top.name}`" in docs, top.name


@pytest.mark.parametrize(
    ("argv", "ranks"),
    [
        ([], [2]),
        (["--devices", "2"], [1]),
        (["--devices", "1"], []),
        (["--devices", "2", "--num-nodes", "2"], [2]),
    ],
)
def test_the_demo_s_default_straggler_is_a_rank_that_exists(argv, ranks):
    from pace_strategy.apps.demo import _stragglers, parse_args

    assert [s.rank for s in _stragglers(parse_args(argv))] == ranks
