"""Input-wait timing: a live loader (plain, or accelerate's DataLoaderShard) reports each blocked `next`,
keeps passing isinstance checks, is never timed twice and gets its own class back on remove()."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from pace_strategy.integrations.data import time_dataloader

pytestmark = pytest.mark.timeout(60)


class SlowDataset(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(0.01)
        return torch.tensor([float(index)])


class FakeSession:
    """What the timing touches: ``session.pacer.add_data_wait(ms)``."""

    def __init__(self) -> None:
        self.waits: list[float] = []
        self.pacer = SimpleNamespace(add_data_wait=self.waits.append)


def check_timing(loader) -> None:
    own = type(loader)
    session, batches = FakeSession(), []
    hook = time_dataloader(loader, lambda: session, on_batch=batches.append)
    assert isinstance(loader, DataLoader) and isinstance(loader, own) and type(loader) is not own
    assert [b.tolist() for b in loader] == [[[0.0], [1.0]], [[2.0], [3.0]]]
    # 4 items x 10 ms, however the loader spreads them (DataLoaderShard fetches one batch ahead)
    assert len(session.waits) == 3 and sum(session.waits) >= 35
    assert batches == [session, session]
    hook.remove()
    assert type(loader) is own
    list(loader)
    assert len(session.waits) == 3


def test_a_plain_dataloader_reports_every_blocked_next():
    check_timing(DataLoader(SlowDataset(), batch_size=2))


def test_accelerates_dataloader_shard_is_timed_in_place():
    from accelerate.data_loader import DataLoaderShard

    loader = DataLoaderShard(SlowDataset(), batch_size=2)
    assert loader.__class__ is DataLoader  # accelerate's disguise, kept while timed
    check_timing(loader)
    assert loader.__class__ is DataLoader


def test_timing_again_replaces_the_session_and_never_times_twice():
    loader = DataLoader(SlowDataset(), batch_size=2)
    first, second = FakeSession(), FakeSession()
    old = time_dataloader(loader, lambda: first)
    timed = type(loader)
    new = time_dataloader(loader, lambda: second)
    assert type(loader) is timed
    list(loader)
    assert first.waits == [] and len(second.waits) == 3
    old.remove()  # superseded: a no-op
    assert type(loader) is timed
    new.remove()
    assert type(loader) is DataLoader


def test_a_session_getter_returning_none_reports_nothing():
    loader, batches = DataLoader(SlowDataset(), batch_size=2), []
    time_dataloader(loader, lambda: None, on_batch=batches.append)
    assert len(list(loader)) == 2 and batches == []


def test_what_is_not_a_dataloader_is_left_alone():
    items = [1, 2]
    assert time_dataloader(items, lambda: FakeSession()) is None and type(items) is list
