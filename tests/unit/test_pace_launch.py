"""``pace launch`` where ``accelerate launch`` stood: the config found where accelerate finds it, the
scheduler's signals passed on to accelerate's launcher, and a launch without a ``pacing_config:``
section said to be plain."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pace_strategy.integrations.accelerate.launch import default_config_file, main, prepare_launch

SECTION = "distributed_type: MULTI_GPU\nnum_processes: 2\nuse_cpu: true\npacing_config:\n  mode: monitor\n"


def test_the_default_config_is_where_accelerate_reads_it():
    assert default_config_file({"HF_HOME": "/x/hf"}) == Path("/x/hf/accelerate/default_config.yaml")
    xdg = default_config_file({"XDG_CACHE_HOME": "/x/cache"})
    assert xdg == Path("/x/cache/huggingface/accelerate/default_config.yaml")
    assert default_config_file({}) == Path.home() / ".cache/huggingface/accelerate/default_config.yaml"


def test_without_config_file_the_default_config_s_section_is_read(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    assert prepare_launch(["train.py"]) == (["train.py"], {}, None)  # no default config: unchanged
    default = tmp_path / "accelerate" / "default_config.yaml"
    default.parent.mkdir()
    default.write_text(SECTION)
    args, env, tmp = prepare_launch(["train.py", "--lr", "1"])
    try:
        assert tmp is not None and args == ["--config_file", str(tmp), "train.py", "--lr", "1"]
        assert env["PACE_MODE"] == "monitor" and env["PACE_CONFIG_SOURCE"] == str(default)
        assert "pacing_config" not in tmp.read_text()  # accelerate reads the config without it
    finally:
        if tmp is not None:
            tmp.unlink()


def test_a_launch_without_a_section_says_it_is_plain(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # no default config either
    script = tmp_path / "train.py"
    script.write_text("print('trained')\n")
    assert main(["--num_processes", "1", "--cpu", str(script)]) == 0
    err = capsys.readouterr().err
    assert "pace launch: no pacing_config: section in the default accelerate config" in err
    assert "running plain accelerate launch" in err


LAUNCHER = """
import os, sys
from pace_strategy.integrations.accelerate.launch import run_forwarding_signals
child = (
    "import signal, sys, time\\n"
    "signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))\\n"
    "print('ready', flush=True)\\n"
    "time.sleep(60)\\n"
)
sys.exit(run_forwarding_signals([sys.executable, "-c", child], os.environ))
"""


def test_the_scheduler_s_signal_reaches_accelerate_s_launcher_and_its_status_comes_back():
    """SIGTERM to ``pace launch`` reaches its child, whose exit status becomes its own; SIGINT alone
    (a terminal's Ctrl-C reaches the child itself) does not end the wait."""
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert launcher.stdout is not None and launcher.stdout.readline().strip() == "ready"
        launcher.send_signal(signal.SIGINT)
        time.sleep(0.5)
        assert launcher.poll() is None  # still waiting for its child
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=30) == 7
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
