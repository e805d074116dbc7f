"""Offline diagnosis of a run record: which failure mode, which ranks and hosts, with plots."""

from pace_strategy.diagnose.config import DiagnosisConfig
from pace_strategy.diagnose.findings import MODES, Diagnosis, Finding, Mode, diagnose
from pace_strategy.telemetry.arrays import RunArrays, find_run_record, load_arrays

__all__ = [
    "MODES",
    "Diagnosis",
    "DiagnosisConfig",
    "Finding",
    "Mode",
    "RunArrays",
    "diagnose",
    "find_run_record",
    "load_arrays",
]
