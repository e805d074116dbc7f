"""Offline diagnosis of a run record: which failure mode, which ranks and hosts, with plots."""

from pace_strategy.diagnose.config import DiagnosisConfig
from pace_strategy.diagnose.findings import MODES, Diagnosis, Finding, Mode, diagnose, diagnose_run
from pace_strategy.telemetry.arrays import RunArrays, RunLines, find_run_record, load_arrays, load_lines

__all__ = [
    "MODES",
    "Diagnosis",
    "DiagnosisConfig",
    "Finding",
    "Mode",
    "RunArrays",
    "RunLines",
    "diagnose",
    "diagnose_run",
    "find_run_record",
    "load_arrays",
    "load_lines",
]
