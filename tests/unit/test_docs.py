"""The docs must stay true to the code: every config field and every tag is documented."""

from dataclasses import fields
from pathlib import Path

from pace_strategy.core.config import PacingConfig
from pace_strategy.diagnose.config import DiagnosisConfig
from pace_strategy.telemetry.schema import LEAD_MS_PREFIX, TAGS

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_every_config_field_is_documented_with_its_default():
    text = (DOCS / "configuration.md").read_text()
    for name, f in PacingConfig.dotted_fields().items():  # a group's fields as ``group.name``
        assert f"| `{name}` | `{f.default!r}` |" in text, f"{name} missing or stale in configuration.md"


def test_every_diagnosis_threshold_is_documented_with_its_default():
    text = (DOCS / "diagnosis.md").read_text()
    for f in fields(DiagnosisConfig):
        assert f"| `{f.name}` | {f.default!r} |" in text, f"{f.name} missing or stale in diagnosis.md"


def test_every_tag_is_documented():
    text = (DOCS / "telemetry.md").read_text()
    for tag in (*TAGS, LEAD_MS_PREFIX):
        assert f"`{tag}" in text, f"{tag} missing from telemetry.md"
