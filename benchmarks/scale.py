"""What the window data path costs as the world grows (not a test; prints what it measured).

Per window of K steps, at each world size W, with the project's own code on synthetic windows (one
process; the collective's cost from the ring model, not measured):

- **bytes each rank receives** in the window all-gather: ``(W - 1) x K x 17 x 8`` (every rank gets
  every other rank's rows);
- **decision**: the Pacer's window decision on every rank that decides: its analysis
  (``Pacer.analyze``: the step labels' check, the window's statistics, the pacing policy's lead
  spread and rebalancing's measure), which runs on the window's side thread, and the controllers'
  decision (``Pacer._apply``), which runs on the training thread; pacing alone, then with
  rebalancing on as well;
- **the side thread beside a step of real compute** (rebalancing on): the training thread runs a
  step of ~50 ms of single-threaded matrix products while the window's side thread analyses the
  window, then collects the analysis and decides: the step's compute time with and without the
  side thread beside it (the GIL and the memory bus are shared), the wait for the side thread, the
  decision on the training thread, and the window's memory freed where its last reference goes;
- **rank 0's telemetry** per window, on its telemetry thread: per-step summaries, the run record's
  lines, and the TensorBoard tags (to a sink that only counts them), with each record format (with
  the columnar one, above ``per_rank_tag_limit`` the summaries build no per-rank tuples and the
  rows are written straight from the window; with node shards, rank 0 summarizes each step from
  every node's per-step reductions, which the leaders send beside their nodes' rows, and only the
  leads' median reads every rank's wait);
- **record bytes per rank-step**: the run record's size over ``W x steps``, and the time rank 0's
  telemetry thread spends writing a window's lines, for both record formats from the same windows:
  ``jsonl`` (per-rank lists in every step line) and ``arrow`` (the step lines without them, and
  the per-rank columns in ``pace_run.ranks.arrow``: float32, zstd);
- the ring all-gather's latency term, ``(W - 1)`` hops at 5 and 30 us a hop (a gloo-over-TCP hop
  costs 20-50 us), which no longer hides behind a short step at thousands of ranks.

A synthetic window: every rank's rows are a plausible step (compute around 40 ms, one rank 3 ms
late, 1 ms jitter), valid, past warm-up, with samples for rebalancing. Timings are the median of
``--repeat`` windows after one unmeasured one; 8,192 ranks takes a few minutes here.

    python benchmarks/scale.py [--ranks 64,1024,8192] [--steps 32] [--repeat 5]

With ``exchange_topology: node_leaders`` (8 ranks per node here) a rank that is not a node leader
receives its node's 7 other rows and the leader's decision, and only parses that decision: both
printed apart, with the leaders' ring latency (N - 1 hops for N nodes). The leaders do what every
rank does in the flat path (the decision column), plus their all-gather.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from pace_strategy.core.clock import ManualClock
from pace_strategy.core.comm import PendingGather, field_major
from pace_strategy.core.config import PacingConfig, RebalanceConfig
from pace_strategy.core.hierarchy import result_of, verdict_of
from pace_strategy.core.inflight import WindowInFlight
from pace_strategy.core.pacer import Pacer
from pace_strategy.core.records import NUM_FIELDS, Field
from pace_strategy.core.shares import ShareSchedule
from pace_strategy.core.summary import StepSummarizer, node_steps, node_transfer
from pace_strategy.telemetry.columnar import RankColumnsWriter
from pace_strategy.telemetry.run_record import RunRecordWriter
from pace_strategy.telemetry.schema import step_metrics

HOP_US = (5.0, 30.0)  #: ring all-gather latency per hop, microseconds: a fast fabric, gloo over TCP
PER_NODE = 8  #: ranks per node, for the node-leader figures


def window(world: int, steps: int, first: int, seed: int) -> torch.Tensor:
    """A gathered window ``[world, steps, NUM_FIELDS]`` of plausible, valid steps, laid out as the
    exchange gathers it (field-major)."""
    g = torch.Generator().manual_seed(seed)
    w = field_major(world, steps, NUM_FIELDS).zero_()
    w[:, :, Field.STEP] = torch.arange(first, first + steps, dtype=torch.float64)
    w[:, :, Field.VALID] = 1.0
    compute = 40.0 + torch.randn(world, steps, generator=g, dtype=torch.float64)
    compute[world // 2] += 3.0  # one slow rank
    w[:, :, Field.COMPUTE_MS] = compute
    w[:, :, Field.WAIT_MS] = compute.amax(dim=0, keepdim=True) - compute + 4.0
    w[:, :, Field.STEP_MS] = compute.amax(dim=0, keepdim=True) + 6.0
    w[:, :, Field.GAP_MS] = 1.0
    w[:, :, Field.OPT_MS] = 1.0
    w[:, :, Field.SAMPLES] = 32.0
    w[:, :, Field.HOST_BOUND] = 1.0
    return w


def measure(world: int, steps: int, repeat: int, out: Path) -> dict[str, float]:
    config = PacingConfig(exchange_every_steps=steps, warmup_steps=0, rebalance=RebalanceConfig(enabled=True))
    # the decision for W ranks, taken here on one process: no group, the exchange is modelled
    pacer = Pacer(config, None, 0, world, ManualClock())
    pacer.attach_shares(ShareSchedule(32 * world, world), 2)
    pacing_only = Pacer(
        PacingConfig(exchange_every_steps=steps, warmup_steps=0), None, 0, world, ManualClock()
    )
    summarizer = StepSummarizer(config.cv_window_steps)
    lean = StepSummarizer(config.cv_window_steps)  # the columnar record's: per-rank tuples only for tags
    sharded = StepSummarizer(config.cv_window_steps)  # rank 0's with node-leader shards (its own state)
    per_rank = world <= config.per_rank_tag_limit
    record = RunRecordWriter(
        out / f"w{world}.jsonl", world_size=world, config=config.to_dict(), topology=[], framework="scale"
    )
    columns = RankColumnsWriter(out / f"w{world}.ranks.arrow", world)
    arrow = RunRecordWriter(
        out / f"a{world}.jsonl",
        world_size=world,
        config=config.to_dict(),
        topology=[],
        framework="scale",
        rank_columns=columns,
    )
    # node_leaders with the columnar record: rank 0 writes the global stream and its node's shard
    shard = RankColumnsWriter(out / f"s{world}.ranks.node0.arrow", PER_NODE, ranks=range(PER_NODE))
    nodes = [{"file": f"s{world}.ranks.node{n}.arrow", "ranks": list(range(n * PER_NODE, (n + 1) * PER_NODE))}
             for n in range(world // PER_NODE)]  # fmt: skip
    global_stream = RunRecordWriter(
        out / f"s{world}.jsonl", world_size=world, config=config.to_dict(), topology=[], framework="scale",
        shards=nodes,
    )  # fmt: skip
    shard_publish_ms: list[float] = []
    # the same work on a step-major copy of each window (the exchange's layout before it gathered
    # field-major): same values, same decisions; what the layout alone costs
    step_major_pacer = Pacer(
        PacingConfig(exchange_every_steps=steps, warmup_steps=0), None, 0, world, ManualClock()
    )
    step_major_summarizer = StepSummarizer(config.cv_window_steps)
    step_major_shard = RankColumnsWriter(out / f"m{world}.ranks.node0.arrow", PER_NODE, ranks=range(PER_NODE))
    step_major_stream = RunRecordWriter(
        out / f"m{world}.jsonl", world_size=world, config=config.to_dict(), topology=[], framework="scale",
        shards=nodes,
    )  # fmt: skip
    step_major_pacing_ms: list[float] = []
    step_major_shard_ms: list[float] = []
    tags = 0
    decide_ms, pacing_ms, publish_ms, jsonl_ms, arrow_ms, arrow_publish_ms = [], [], [], [], [], []
    follow_ms: list[float] = []
    pacing_thread_ms: list[float] = []  # the part of the decision on the training thread
    decide_thread_ms: list[float] = []
    verdict_ms: list[float] = []
    verdict_bytes: list[int] = []
    for i in range(repeat + 1):
        g = window(world, steps, i * steps, seed=i)
        nodes = torch.stack(
            [node_steps(g[r : r + PER_NODE], range(r, r + PER_NODE)) for r in range(0, world, PER_NODE)]
        )
        started = time.perf_counter()
        paced_analysis = pacing_only.analyze(g, pacing_only._window)  # on the window's side thread
        paced_analysed = time.perf_counter()
        paced_result = pacing_only._apply(paced_analysis)  # on the training thread
        paced = time.perf_counter()
        if i:
            pacing_ms.append((paced - started) * 1e3)
            pacing_thread_ms.append((paced - paced_analysed) * 1e3)
        started = time.perf_counter()
        analysis = pacer.analyze(g, pacer._window)
        analysed = time.perf_counter()
        result = pacer._apply(analysis)
        decided = time.perf_counter()
        if i:
            decide_thread_ms.append((decided - analysed) * 1e3)
        # exchange_topology node_leaders: what a rank that is not a leader does with the decision
        meta, vectors = verdict_of(result)
        text = json.dumps({**meta, "$vectors": list(vectors)}).encode()  # as HierarchicalExchange sends it
        rows = torch.tensor([list(v) for v in vectors.values()], dtype=torch.float64)
        followed = time.perf_counter()
        if i:  # a leader's: its verdict made ready for its node, on the training thread
            verdict_ms.append((followed - decided) * 1e3)
        received = json.loads(text)
        result_of((received, dict(zip(received.pop("$vectors"), rows, strict=True))), world)
        follow_ms.append((time.perf_counter() - followed) * 1e3)
        verdict_bytes.append(len(text) + rows.numel() * 8)
        summaries = summarizer.summarize(g)
        for s in summaries:
            tags += len(step_metrics(s, config.per_rank_tag_limit, batch_shares=True))
        written = time.perf_counter()
        record.write_window(summaries, None)
        published = time.perf_counter()
        # rank 0's telemetry with the columnar record: the same tags, the rows straight from the window
        lean_summaries = lean.summarize(g, per_rank=per_rank)
        for s in lean_summaries:
            step_metrics(s, config.per_rank_tag_limit, batch_shares=True)
        summarized = time.perf_counter()
        arrow.write_window(lean_summaries, None, gathered=g)
        arrow_done = time.perf_counter()
        shard.write_gathered(g, node_transfer(nodes))  # on the training thread, as every leader does
        # every node's per-step reductions, as its leader sends them beside its node's rows
        shard_summaries = sharded.summarize(g, per_rank=per_rank, nodes=nodes)
        for s in shard_summaries:
            step_metrics(s, config.per_rank_tag_limit, batch_shares=True)
        global_stream.write_window(shard_summaries, None)
        if i:
            shard_publish_ms.append((time.perf_counter() - arrow_done) * 1e3)
        rowwise = g.contiguous()  # [W, K, 17] step-major
        layout_started = time.perf_counter()
        if step_major_pacer._decide(rowwise).decision != paced_result.decision:
            raise AssertionError("the window's layout changed a decision")
        layout_decided = time.perf_counter()
        step_major_shard.write_gathered(rowwise, node_transfer(nodes))
        rowwise_summaries = step_major_summarizer.summarize(rowwise, per_rank=per_rank, nodes=nodes)
        for s in rowwise_summaries:
            step_metrics(s, config.per_rank_tag_limit, batch_shares=True)
        step_major_stream.write_window(rowwise_summaries, None)
        if rowwise_summaries != shard_summaries:
            raise AssertionError("the window's layout changed a summary")
        if shard_summaries != lean_summaries:
            raise AssertionError("the nodes' reductions changed a summary")
        if i:
            step_major_pacing_ms.append((layout_decided - layout_started) * 1e3)
            step_major_shard_ms.append((time.perf_counter() - layout_decided) * 1e3)
        if i:  # the first window pays one-off costs (imports, allocations)
            decide_ms.append((decided - started) * 1e3)
            publish_ms.append((published - decided) * 1e3)
            jsonl_ms.append((published - written) * 1e3)
            arrow_ms.append((arrow_done - summarized) * 1e3)
            arrow_publish_ms.append((arrow_done - published) * 1e3)
    record.close()
    arrow.close()
    global_stream.close()
    shard.close()
    step_major_shard.close()
    step_major_stream.close()
    size = (out / f"w{world}.jsonl").stat().st_size
    arrow_size = (out / f"a{world}.jsonl").stat().st_size + columns.path.stat().st_size
    rank_steps = world * steps * (repeat + 1)
    received = (world - 1) * steps * NUM_FIELDS * 8
    return {
        "ranks": world,
        "bytes_received_per_window": received,
        "ring_latency_ms_fast": (world - 1) * HOP_US[0] / 1e3,
        "ring_latency_ms_tcp": (world - 1) * HOP_US[1] / 1e3,
        "decision_ms_pacing": statistics.median(pacing_ms),
        "decision_ms": statistics.median(decide_ms),
        "decision_ms_pacing_training_thread": statistics.median(pacing_thread_ms),
        "decision_ms_training_thread": statistics.median(decide_thread_ms),
        "leader_verdict_ms": statistics.median(verdict_ms),
        "rank0_telemetry_ms": statistics.median(publish_ms),
        # node_leaders, 8 ranks per node: a non-leader receives its 7 peers' rows and the verdict
        "node_leaders_bytes_received_per_window": (PER_NODE - 1) * steps * NUM_FIELDS * 8
        + statistics.median(verdict_bytes),
        "node_leaders_follow_ms": statistics.median(follow_ms),
        "leaders_ring_latency_ms_tcp": (world // PER_NODE - 1) * HOP_US[1] / 1e3,
        "rank0_telemetry_ms_arrow": statistics.median(arrow_publish_ms),
        "rank0_telemetry_ms_shards": statistics.median(shard_publish_ms),
        "decision_ms_pacing_step_major": statistics.median(step_major_pacing_ms),
        "rank0_telemetry_ms_shards_step_major": statistics.median(step_major_shard_ms),
        "record_bytes_per_rank_step": size / rank_steps,
        "arrow_record_bytes_per_rank_step": arrow_size / rank_steps,
        "record_write_ms_jsonl": statistics.median(jsonl_ms),
        "record_write_ms_arrow": statistics.median(arrow_ms),
        "tags_per_window": tags / (repeat + 1),
    }


def _matmul_step(target_ms: float) -> tuple[torch.Tensor, int]:
    """A matrix and how many products of it take about ``target_ms`` on this thread."""
    a = torch.randn(256, 256, dtype=torch.float32)
    started = time.perf_counter()
    for _ in range(20):
        a @ a
    per = (time.perf_counter() - started) / 20
    return a, max(1, round(target_ms / 1e3 / per))


def beside_a_step(world: int, steps: int, repeat: int, step_ms: float = 50.0) -> dict[str, float]:
    """The window's side thread analysing a window while the training thread computes one step."""
    config = PacingConfig(exchange_every_steps=steps, warmup_steps=0, rebalance=RebalanceConfig(enabled=True))
    pacer = Pacer(config, None, 0, world, ManualClock())
    pacer.attach_shares(ShareSchedule(32 * world, world), 2)
    a, products = _matmul_step(step_ms)

    def step() -> float:
        started = time.perf_counter()
        for _ in range(products):
            a @ a
        return (time.perf_counter() - started) * 1e3

    alone, beside, join, decide, release = [], [], [], [], []
    for i in range(repeat + 1):
        g = window(world, steps, i * steps, seed=100 + i)
        quiet = step()
        gather = PendingGather(work=None, outputs=[], first_step=i * steps, last_step=(i + 1) * steps - 1)
        index = pacer._window
        flight = WindowInFlight(gather, lambda g=g: g, lambda w, index=index: pacer.analyze(w, index))
        busy = step()  # the step the window's analysis runs beside
        started = time.perf_counter()
        analysis = flight.result(60.0, 0, world)
        joined = time.perf_counter()
        pacer._apply(analysis)
        decided = time.perf_counter()
        # the window's last references: where a WindowResult is dropped (the training thread, or
        # rank 0's telemetry thread), the window's memory goes back to the system (36 MB at 8,192
        # ranks: an munmap), timed apart (it would otherwise land in the next window's wait)
        del analysis, flight, g
        released = time.perf_counter()
        if i:
            alone.append(quiet)
            beside.append(busy)
            join.append((joined - started) * 1e3)
            decide.append((decided - joined) * 1e3)
            release.append((released - decided) * 1e3)
    return {
        "ranks": world,
        "step_ms_alone": statistics.median(alone),
        "step_ms_beside_side_thread": statistics.median(beside),
        "join_wait_ms": statistics.median(join),
        "decide_ms_training_thread": statistics.median(decide),
        "release_ms": statistics.median(release),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="64,1024,8192")
    p.add_argument("--steps", type=int, default=32, help="K, steps per window")
    p.add_argument("--repeat", type=int, default=5, help="measured windows per world size")
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = []
    print(
        f"{'ranks':>6} {'received/window':>16} {'ring latency':>16} {'decision (+ rebalancing)':>25} "
        f"{'rank-0 telemetry jsonl | arrow':>31} {'record jsonl | arrow (write/window)':>38} "
        f"{'tags/window':>12}"
    )
    with tempfile.TemporaryDirectory(prefix="pace-scale-") as tmp:
        for world in (int(r) for r in args.ranks.split(",")):
            r = measure(world, args.steps, args.repeat, Path(tmp))
            rows.append(r)
            print(
                f"{world:>6,} {r['bytes_received_per_window'] / 1e6:>13.2f} MB "
                f"{r['ring_latency_ms_fast']:>6.1f}-{r['ring_latency_ms_tcp']:<5.0f} ms "
                f"{r['decision_ms_pacing']:>9.1f} ms ({r['decision_ms']:>7.1f} ms) "
                f"{r['rank0_telemetry_ms']:>14.1f} ms | {r['rank0_telemetry_ms_arrow']:>7.1f} ms "
                f"{r['record_bytes_per_rank_step']:>5.0f} B/rs {r['record_write_ms_jsonl']:>6.1f} ms | "
                f"{r['arrow_record_bytes_per_rank_step']:>4.1f} B/rs {r['record_write_ms_arrow']:>6.1f} ms "
                f"{r['tags_per_window']:>12,.0f}",
                flush=True,
            )
    print(f"\nexchange_topology node_leaders, {PER_NODE} ranks per node: a rank that is not a leader")
    print(
        f"{'ranks':>6} {'received/window':>16} {'decision work':>14} {'leaders ring (30 us a hop)':>27}"
        f"{'rank-0 telemetry, arrow shards':>32}"
    )
    for r in rows:
        print(
            f"{r['ranks']:>6,} {r['node_leaders_bytes_received_per_window'] / 1e6:>13.3f} MB "
            f"{r['node_leaders_follow_ms']:>11.2f} ms {r['leaders_ring_latency_ms_tcp']:>24.1f} ms"
            f"{r['rank0_telemetry_ms_shards']:>29.1f} ms"
        )
    print("\nthe window's layout: step-major (the exchange's before) | field-major (now), same values")
    print(f"{'ranks':>6} {'pacing decision':>24} {'rank-0 telemetry, arrow shards':>32}")
    for r in rows:
        before, now = r["decision_ms_pacing_step_major"], r["decision_ms_pacing"]
        print(
            f"{r['ranks']:>6,} {before:>8.1f} | {now:>5.1f} ms (x{before / now:.1f}) "
            f"{r['rank0_telemetry_ms_shards_step_major']:>12.1f} | {r['rank0_telemetry_ms_shards']:>5.1f} ms"
        )
    print(
        "\nthe decision: analysis (side thread) + decide (training thread), pacing | with rebalancing;"
        " a leader's verdict for its node (training thread)"
    )
    for r in rows:
        pacing_side = r["decision_ms_pacing"] - r["decision_ms_pacing_training_thread"]
        side = r["decision_ms"] - r["decision_ms_training_thread"]
        print(
            f"{r['ranks']:>6,} {pacing_side:>6.1f} + {r['decision_ms_pacing_training_thread']:>5.2f} ms | "
            f"{side:>6.1f} + {r['decision_ms_training_thread']:>5.2f} ms; {r['leader_verdict_ms']:>5.2f} ms"
        )
    print("\nthe side thread beside a ~50 ms step of matrix products (rebalancing on)")
    print(
        f"{'ranks':>6} {'step alone':>11} {'step beside it':>15} {'wait for it':>12} {'decide':>9} "
        f"{'window freed':>13}"
    )
    for world in (int(r) for r in args.ranks.split(",")):
        b = beside_a_step(world, args.steps, args.repeat)
        r = next(r for r in rows if r["ranks"] == world)
        r.update({f"beside_step_{k}": v for k, v in b.items() if k != "ranks"})
        print(
            f"{world:>6,} {b['step_ms_alone']:>8.1f} ms {b['step_ms_beside_side_thread']:>9.1f} ms "
            f"(x{b['step_ms_beside_side_thread'] / b['step_ms_alone']:.3f}) {b['join_wait_ms']:>8.2f} ms "
            f"{b['decide_ms_training_thread']:>6.2f} ms {b['release_ms']:>10.2f} ms",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
