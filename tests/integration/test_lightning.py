"""Real Lightning Trainers: 2 CPU processes with gloo through the demo script, and one in-process."""

from __future__ import annotations

import os
import statistics
import subprocess
import time
import urllib.request
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader

from pace_strategy.integrations.lightning import PacedDDPStrategy
from pace_strategy.telemetry import TAGS, lead_tag, read_run_record
from tests.integration.helpers import (
    check_dashboard,
    demo_command,
    free_port,
    only_version_dir,
    parse_metrics,
    read_scalars,
    run_demo,
    why_failed,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(200)]

COMMON = ("--devices", "2", "--compute-ms", "10", "--quiet")
WARMUP = 5  # PacingConfig().warmup_steps


@pytest.mark.alone
@pytest.mark.long  # Lightning's TensorBoard tags: test_fabric, test_artifacts; the endpoint: test_pytorch
def test_paced_ddp_telemetry_names_the_injected_straggler(tmp_path):
    """TensorBoard (with its dashboard), the run record, the demo's summary and, while the Trainer
    trains, rank 0's live Prometheus endpoint scraped over HTTP: one run."""
    steps, port = 110, free_port()
    command = demo_command(
        tmp_path, *COMMON, "--steps", str(steps), "--straggler", "1:40", "--strategy", "paced_ddp",
        "--pacing", f"metrics_port={port}",
    )  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    # files, not pipes nobody reads while it trains
    with (tmp_path / "out.log").open("w") as out, (tmp_path / "err.log").open("w") as err:
        proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=out, stderr=err)
        try:
            scraped = scrape_while_running(proc, port, until_steps=40, timeout_s=150)
            proc.wait(timeout=150)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    stdout, stderr = (tmp_path / "out.log").read_text(), (tmp_path / "err.log").read_text()
    assert proc.returncode == 0, why_failed(stderr, 4000)
    assert scraped.get("pace_steps_total", 0.0) >= 40, scraped  # scraped over HTTP during training
    assert scraped["pace_straggler_rank"] == 1.0 and scraped['pace_lead_ms{rank="1"}'] == 0.0, scraped
    # the lead gauge is one step's (the last of a window): checked below to be a step of this run's
    # record; the injection's band is the medians' (one step's lead varies with what rank 0 did)
    log_dir = only_version_dir(tmp_path)
    scalars = read_scalars(log_dir)
    charts = check_dashboard(log_dir)  # TensorBoard's Custom Scalars tab: the ranks side by side
    lead = [series for title, (kind, series) in charts.items() if "lead per rank" in title]
    assert lead == [[r"pace/lead_ms/rank_\d+"]], charts
    for tag in (*TAGS, lead_tag(0), lead_tag(1)):
        assert tag in scalars, f"missing {tag}; have {sorted(scalars)}"
        assert sorted(scalars[tag]) == list(range(steps)), f"{tag} not logged at every global step"
    post = [s for s in range(steps) if s >= WARMUP]
    stragglers = [scalars["pace/straggler_rank"][s] for s in post]
    assert sum(r == 1.0 for r in stragglers) / len(post) >= 0.9, stragglers
    median_skew = statistics.median(scalars["pace/skew_ms"][s] for s in post)
    assert abs(median_skew - 40.0) <= 0.3 * 40.0, median_skew
    # the grad-ready monitor (the default) saw every step's sync point; it does not time buckets
    record = read_run_record(log_dir)
    lead0 = scraped['pace_lead_ms{rank="0"}']
    assert lead0 > 0.0 and min(abs(s["ranks"]["lead_ms"][0] - lead0) for s in record.steps) < 0.01, lead0
    assert record.end["status"] == "completed"
    assert [s["step"] for s in record.steps] == list(range(steps))
    assert all(s["valid"] and s["buckets"] == 0 for s in record.steps)
    assert [t["rank"] for t in record.header["topology"]] == [0, 1]
    assert [t["local_rank"] for t in record.header["topology"]] == [0, 1]
    assert [t["dataloader_workers"] for t in record.header["topology"]] == [0, 0]  # the demo's loader
    # the demo's own summary table, with no third-party deprecation warning before it
    assert "straggler             rank 1 in" in stdout
    assert "pace_run.jsonl" in stdout
    assert "LeafSpec" not in stderr, why_failed(stderr, 2000)


def scrape_while_running(
    proc: subprocess.Popen[bytes], port: int, until_steps: int, timeout_s: float
) -> dict:
    """The last scrape of rank 0's endpoint while ``proc`` trains, once it counts ``until_steps``."""
    scraped: dict[str, float] = {}
    deadline = time.time() + timeout_s
    while proc.poll() is None and time.time() < deadline:
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        except OSError:  # not serving yet (the trainer starts the session at setup)
            time.sleep(0.2)
            continue
        scraped = parse_metrics(text)
        if scraped.get("pace_steps_total", 0.0) >= until_steps:
            break
        time.sleep(0.2)
    return scraped


def test_forced_pacing_gives_weights_identical_to_plain_ddp(tmp_path):
    """Both with their ranks forked from the launcher (no second Lightning import per run): the
    arithmetic does not depend on how the ranks started."""
    plain = tmp_path / "plain.pt"
    paced = tmp_path / "paced.pt"
    args = (*COMMON, "--steps", "30", "--straggler", "1:30")
    a = run_demo(tmp_path, *args, "--strategy", "ddp_fork", "--name", "plain", "--save-weights", str(plain))
    assert a.returncode == 0, why_failed(a.stderr, 4000)
    b = run_demo(
        tmp_path,
        *args,
        "--strategy",
        "paced_ddp_fork",
        "--name",
        "paced",
        "--save-weights",
        str(paced),
        "--pacing",
        "mode=forced",
        "--pacing",
        "exchange_every_steps=4",
        "--pacing",
        "max_delay_step_fraction=0.5",
    )
    assert b.returncode == 0, why_failed(b.stderr, 4000)
    record = read_run_record(only_version_dir(tmp_path, "paced"))
    delays = [s["ranks"]["delay_ms"][0] for s in record.steps]
    assert max(delays) > 1.0, f"pacing was never applied: {delays}"
    wa, wb = torch.load(plain), torch.load(paced)
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), f"{key} differs between plain and paced DDP"


def test_a_rank_that_dies_mid_run_fails_the_others_quickly_and_keeps_the_record(tmp_path):
    out = run_demo(
        tmp_path,
        *COMMON,
        "--steps",
        "200",
        "--straggler",
        "",
        "--fail-at",
        "1:12",
        "--pacing",
        "exchange_every_steps=4",
        "--pacing",
        "exchange_timeout_s=20",
        timeout=120,
    )
    assert out.returncode != 0
    assert "fault injection: exiting at step 12" in out.stdout
    record = read_run_record(only_version_dir(tmp_path))
    assert len(record.steps) >= 8  # windows exchanged before the failure were kept, in either case
    if "Forcefully terminating all other processes" in out.stderr and record.end is None:
        # Lightning's child-process observer polls every 5 s and SIGKILLs rank 0 when it sees the
        # dead child; when its poll lands within the moment rank 0 needs to see the closed
        # connection (seen once under the full suite's load), nothing can log or close the record.
        return
    assert "[rank 0/2] pace_strategy: training failed after" in out.stderr
    assert record.end is not None and record.end["status"] == "failed"


def test_bad_configuration_fails_before_training_with_the_field_named(tmp_path):
    out = run_demo(tmp_path, *COMMON, "--steps", "5", "--pacing", "max_delay_ms=-5", timeout=60)
    assert out.returncode != 0
    assert "PacingConfig.max_delay_ms=-5" in out.stderr and ">= 0" in out.stderr
    assert not (tmp_path / "runs").exists(), "nothing may start on bad configuration"
    out = run_demo(tmp_path, *COMMON, "--steps", "5", "--pacing", "exchange_every_step=8", timeout=60)
    assert "Did you mean 'exchange_every_steps'?" in out.stderr
    # an injection into a rank the run does not have (2 ranks: 0 and 1) is refused, naming the flag
    out = run_demo(tmp_path, *COMMON, "--steps", "5", "--straggler", "2:30", timeout=60)
    assert (
        out.returncode == 2 and "--straggler: rank 2 does not exist in this run: expected 0..1" in out.stderr
    )
    out = run_demo(tmp_path, *COMMON, "--steps", "5", "--straggler-local", "3:30", timeout=60)
    assert out.returncode == 2 and "--straggler-local: local index 3 does not exist" in out.stderr
    assert not (tmp_path / "runs").exists()


class _TinyModule(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        return self.net(batch).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("monitor", ["grad_ready", "comm_hook"])
def test_a_user_comm_hook_does_the_communication_on_cpu(tmp_path, monitor):
    # Stock DDPStrategy drops comm hooks on CPU; the paced strategy registers the user's (wrapped by
    # its wrapper) on every device, and it still does the reduction under either monitor.
    buckets, wrapped_calls = [], []

    def counting_hook(state, bucket):
        buckets.append(bucket.index())
        return default_hooks.allreduce_hook(state, bucket)

    def wrapper(hook):
        def wrapped(state, bucket):
            wrapped_calls.append(bucket.index())
            return hook(state, bucket)

        return wrapped

    strategy = PacedDDPStrategy(  # one process monitors only when a record is asked for
        pacing={"ddp_monitor": monitor},
        ddp_comm_hook=counting_hook,
        ddp_comm_wrapper=wrapper,
        run_dir=tmp_path,
    )
    trainer = Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    loader = DataLoader(torch.randn(12, 4), batch_size=4)
    with mock.patch.dict(os.environ):  # Lightning exports MASTER_ADDR/MASTER_PORT for its group
        try:
            trainer.fit(_TinyModule(), loader)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    assert buckets == wrapped_calls == [0, 0, 0], (buckets, wrapped_calls)
    assert [s["step"] for s in read_run_record(tmp_path).steps] == [0, 1, 2]
