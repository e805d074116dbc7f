"""PacingCallback in one process, on a stand-in Trainer: what it hands attach_pacing, that it finishes
at the end of training, and the pace/ tags in the Trainer's TensorBoard directory at the Trainer's
global step, also for the window published after the Trainer closed its writer. The real Trainer on
2 processes runs in tests/integration/test_zero_code.py."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import pytest
from torch.utils.tensorboard import SummaryWriter
from transformers import TrainerControl, TrainerState
from transformers.integrations import TensorBoardCallback

import pace_strategy
from pace_strategy.integrations import huggingface
from pace_strategy.integrations.huggingface import PacingCallback
from tests.integration.helpers import read_scalars

pytestmark = pytest.mark.timeout(60)


def stand_in_trainer(tmp_path, tensorboard=True):
    """A Trainer as the callback sees it (rank 0), with its TensorBoardCallback's writer."""
    writer = SummaryWriter(log_dir=str(tmp_path / "runs" / "x")) if tensorboard else None
    callbacks = [TensorBoardCallback(tb_writer=writer)] if tensorboard else []
    trainer = SimpleNamespace(
        accelerator=SimpleNamespace(num_processes=2),
        model_wrapped="the wrapped model",
        optimizer="the prepared optimizer",
        callback_handler=SimpleNamespace(callbacks=callbacks),
    )
    return trainer, (callbacks or [None])[0]


class Handle:
    session = None  # no session: nothing to time

    def __init__(self, **kwargs):
        self.kwargs, self.finished = kwargs, 0

    def finish(self):
        self.finished += 1


@pytest.fixture
def attached(monkeypatch):
    calls = []

    def attach_pacing(accelerator, model, config, **kwargs):
        calls.append(Handle(accelerator=accelerator, model=model, config=config, **kwargs))
        return calls[-1]

    monkeypatch.setattr(huggingface, "attach_pacing", attach_pacing)
    return calls


def test_is_a_lazy_public_name():
    assert pace_strategy.PacingCallback is PacingCallback


def test_attaches_to_the_wrapped_model_and_finishes_at_train_end(tmp_path, attached):
    trainer, tensorboard = stand_in_trainer(tmp_path)
    callback = PacingCallback(trainer)
    args = SimpleNamespace(output_dir=str(tmp_path), logging_strategy="steps", logging_steps=10)
    state, control = TrainerState(), TrainerControl()
    callback.on_train_begin(args, state, control, optimizer=None, train_dataloader="the loader")
    (handle,) = attached
    # the configuration of the PACE_* variables (none: the defaults), tagging as often as the Trainer logs
    assert handle.kwargs["model"] == "the wrapped model"
    assert handle.kwargs["config"] == pace_strategy.PacingConfig(tag_every_steps=10)
    assert handle.kwargs["optimizer"] == "the prepared optimizer"
    assert handle.kwargs["dataloaders"] == ["the loader"]
    assert handle.kwargs["run_dir"] == tmp_path / "runs" / "x"  # beside the Trainer's events
    callback.on_train_end(args, state, control)
    callback.on_train_end(args, state, control)
    assert handle.finished == 1 and callback.handle is None
    tensorboard.on_train_end(args, state, control)


def test_tags_go_to_the_trainer_writer_at_its_global_step_and_after_it_closed(tmp_path, attached):
    trainer, tensorboard = stand_in_trainer(tmp_path)
    callback = PacingCallback(trainer)
    args, state, control = SimpleNamespace(output_dir=str(tmp_path)), TrainerState(), TrainerControl()
    state.global_step = 10  # resumed at step 10: pace step 0 is the Trainer's step 11
    callback.on_train_begin(args, state, control, optimizer="o", train_dataloader=None)
    sink = attached[0].kwargs["metrics_sink"]
    window = threading.Thread(target=lambda: [sink({"pace/skew_ms": 40.0 + i}, i) for i in range(4)])
    window.start()  # the session's telemetry thread
    window.join()
    tensorboard.on_train_end(args, state, control)  # the Trainer closes its writer first
    sink({"pace/skew_ms": 44.0}, 4)  # the last window, published by finish()
    callback.on_train_end(args, state, control)
    assert read_scalars(tmp_path / "runs" / "x")["pace/skew_ms"] == {11 + i: 40.0 + i for i in range(5)}
    assert len(list((tmp_path / "runs" / "x").glob("events.out.tfevents.*"))) == 2


def test_without_a_tensorboard_writer_only_the_run_record(tmp_path, attached, monkeypatch):
    trainer, _ = stand_in_trainer(tmp_path, tensorboard=False)
    monkeypatch.setenv("PACE_RUN_DIR", str(tmp_path / "env"))
    callback = PacingCallback(trainer)
    args, state, control = SimpleNamespace(output_dir=str(tmp_path)), TrainerState(), TrainerControl()
    callback.on_train_begin(args, state, control)
    assert attached[0].kwargs["run_dir"] == tmp_path / "env"
    attached[0].kwargs["metrics_sink"]({"pace/skew_ms": 1.0}, 0)  # dropped, no error
    callback.on_train_end(args, state, control)
    assert not list(tmp_path.rglob("events.out.tfevents.*"))


def test_the_automatic_callback_gives_way(tmp_path, attached, caplog):
    trainer, tensorboard = stand_in_trainer(tmp_path)
    args, state, control = SimpleNamespace(output_dir=str(tmp_path)), TrainerState(), TrainerControl()
    automatic = PacingCallback(trainer)
    automatic._automatic = True
    trainer.callback_handler.callbacks.append(automatic)
    with caplog.at_level(logging.WARNING):
        automatic.on_train_begin(args, state, control)  # the model is not DDP: not paced, and said
    assert not attached and "neither DDP nor FSDP2" in caplog.text
    trainer.callback_handler.callbacks.append(PacingCallback(trainer, run_dir=tmp_path / "mine"))
    automatic.on_train_begin(args, state, control)  # the script added its own
    trainer.callback_handler.callbacks.pop()
    trainer.accelerator.num_processes = 1
    automatic.on_train_begin(args, state, control)  # one process: nothing to pace
    assert not attached
    tensorboard.on_train_end(args, state, control)


def test_tags_reach_every_reporting_callback_on_the_training_thread_in_step_order(tmp_path, attached):
    """report_to beyond TensorBoard (here MLflow's callback class, its on_log recording what it is
    given; the real MLflow store is read in tests/integration/test_zero_code.py): the telemetry
    thread's tags wait for the end of a step and go through the callback's on_log, on the training
    thread, at the Trainer's global step they describe; at the last step pacing finishes before
    the Trainer ends the other callbacks' runs (their on_train_end comes first), so the last
    window's tags get there too, and nothing goes to them after."""
    from transformers.integrations import MLflowCallback

    class Recorded(MLflowCallback):
        def __init__(self):
            super().__init__()
            self.logged = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logged.append((state.global_step, dict(logs), threading.current_thread()))

    trainer, tensorboard = stand_in_trainer(tmp_path)
    other = Recorded()
    trainer.callback_handler.callbacks.append(other)
    callback = PacingCallback(trainer)
    args, state, control = SimpleNamespace(output_dir=str(tmp_path)), TrainerState(), TrainerControl()
    callback.on_train_begin(args, state, control, optimizer="o", train_dataloader=None)
    handle = attached[0]
    sink = handle.kwargs["metrics_sink"]
    window = threading.Thread(target=lambda: [sink({"pace/skew_ms": 40.0 + i}, i) for i in range(3)])
    window.start()  # the session's telemetry thread: nothing reaches the other callback from it
    window.join()
    assert other.logged == []
    state.global_step = 3
    callback.on_step_end(args, state, control)  # the training thread: steps 1-3, in order
    me = threading.current_thread()
    assert other.logged == [(1 + i, {"pace/skew_ms": 40.0 + i}, me) for i in range(3)]
    assert state.global_step == 3  # the Trainer's own state untouched
    handle.finish = lambda: (sink({"pace/skew_ms": 43.0}, 3), setattr(handle, "finished", 1))  # last window
    state.global_step, control.should_training_stop = 4, True
    callback.on_step_end(args, state, control)
    assert handle.finished == 1 and callback.handle is None
    assert [step for step, _, _ in other.logged] == [1, 2, 3, 4]
    sink({"pace/skew_ms": 44.0}, 4)  # too late: the other trackers have ended (TensorBoard has it)
    callback.on_train_end(args, state, control)  # finished already: nothing more
    assert handle.finished == 1 and len(other.logged) == 4
    tensorboard.on_train_end(args, state, control)  # closes (and so flushes) the Trainer's writer
    assert read_scalars(tmp_path / "runs" / "x")["pace/skew_ms"] == {1 + i: 40.0 + i for i in range(5)}
