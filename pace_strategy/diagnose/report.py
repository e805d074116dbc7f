"""The diagnosis report: plots (matplotlib, Agg) and a self-contained HTML page plus Markdown."""

from __future__ import annotations

import base64
import html
import importlib.util
import io
import json
from pathlib import Path
from typing import Any

import numpy as np

from pace_strategy._imports import extra_error
from pace_strategy.diagnose.config import DiagnosisConfig
from pace_strategy.diagnose.digest import RunDigest, digest_run
from pace_strategy.diagnose.result import Diagnosis, Mode, projection_text
from pace_strategy.telemetry.arrays import RunLines

__all__ = ["PLOTS", "render_report"]

#: the plots of every report; ``projection`` is drawn when the findings were projected to scale
PLOTS = ("skew", "lead_heatmap", "stragglers", "step_time", "delays", "projection")


def _bin_steps(values: np.ndarray, max_columns: int) -> tuple[np.ndarray, np.ndarray]:
    """Mean of ``values`` ([steps, ...]) over at most ``max_columns`` equal bins of steps."""
    n = values.shape[0]
    if n <= max_columns:
        return np.arange(n), values
    edges = np.linspace(0, n, max_columns + 1).astype(int)
    binned = np.add.reduceat(values, edges[:-1], axis=0) / np.diff(edges).reshape(
        -1, *([1] * (values.ndim - 1))
    )
    return edges[:-1], binned


def index_bars(ax: Any, values: list[float], label: str) -> None:
    """One bar per rank (or node) on ``ax``, with integer ticks only: matplotlib's default locator puts
    ticks at -0.5, 0.0, 0.5 ... for a few bars, and thousands of labels at 1,024 ranks."""
    from matplotlib.ticker import MaxNLocator

    ax.bar(range(len(values)), values)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=min(max(len(values), 1), 16)))
    ax.set_xlim(-0.6, len(values) - 0.4)
    ax.set_xlabel(label)


def _mark_episodes(ax: Any, a: RunLines, diagnosis: Diagnosis, digest: RunDigest) -> None:
    """Outline each straggler episode's stretch on the heat map, on its ranks' rows (or their nodes')."""
    from matplotlib.patches import Rectangle

    labels = digest.heat_labels
    nodes = [str(n) for n in a.topology("node_rank")]
    edges = digest.late_edges  # the heat map's bins (the lateness bins are binned as it is)
    for f in diagnosis.findings:
        if f.mode is not Mode.STRAGGLER_EPISODE:
            continue
        rows = {labels.index(n) for r in f.ranks for n in (f"r{r}", f"node {nodes[r]}") if n in labels}
        for episode in f.details.get("episodes", []):
            first, last = (int(np.searchsorted(a.step, label)) for label in episode["steps"])
            first, last = (int(np.searchsorted(edges, i, side="right")) - 1 for i in (first, last))
            for row in rows:
                ax.add_patch(
                    Rectangle(
                        (first - 0.5, row - 0.5), last - first + 1, 1, fill=False, edgecolor="red", lw=1.5
                    )
                )


def _figures(a: RunLines, cfg: DiagnosisConfig, diagnosis: Diagnosis, digest: RunDigest) -> dict[str, bytes]:
    """Every plot of the report, as PNG bytes by name (a plot with nothing to show is left out);
    none without matplotlib (the ``plots`` extra)."""
    if importlib.util.find_spec("matplotlib") is None:
        return {}
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out: dict[str, bytes] = {}
    plots = {
        "skew": _skew_plot,
        "lead_heatmap": _heatmap_plot,
        "stragglers": _stragglers_plot,
        "step_time": _step_time_plot,
        "delays": _delays_plot,
        "projection": _projection_plot,
    }
    for name, plot in plots.items():
        fig = plot(plt, a, cfg, diagnosis, digest)
        if fig is None:
            continue
        buf = io.BytesIO()
        fig.tight_layout()
        fig.savefig(buf, format="png", dpi=110)
        plt.close(fig)
        out[name] = buf.getvalue()
    return out


def _skew_plot(plt: Any, a: RunLines, cfg: DiagnosisConfig, diagnosis: Diagnosis, digest: RunDigest) -> Any:
    idx, sk = _bin_steps(digest.skew, cfg.max_heatmap_columns)
    fig, ax = plt.subplots(figsize=(9, 3))
    ax.plot(a.step[idx], sk, lw=0.8, label="skew")
    _, tr = _bin_steps(digest.transfer, cfg.max_heatmap_columns)
    ax.plot(a.step[idx], tr, lw=0.8, alpha=0.7, label="transfer (min wait)")
    ax.set_xlabel("step")
    ax.set_ylabel("ms")
    ax.set_title("Skew at the sync point over steps")
    ax.legend(loc="upper right")
    return fig


def _heatmap_plot(
    plt: Any, a: RunLines, cfg: DiagnosisConfig, diagnosis: Diagnosis, digest: RunDigest
) -> Any:
    # ranks x steps, grouped by node; aggregated by node for very many ranks (each node's mean lead
    # from its own ranks' waits), binned over steps as _bin_steps bins: the digest's
    binned, labels = digest.heat, digest.heat_labels
    fig, ax = plt.subplots(figsize=(9, max(2.5, min(8.0, 0.25 * len(labels) + 1.5))))
    im = ax.imshow(binned.T, aspect="auto", interpolation="nearest", cmap="viridis")
    ax.set_xlabel(f"step bin ({digest.steps} steps)" if digest.heat_binned else "step")
    if len(labels) <= 40:
        ax.set_yticks(range(len(labels)), labels)
    ax.set_ylabel("rank (grouped by node)" if len(labels) == a.world_size else "node (mean over its ranks)")
    ax.set_title("Lead per rank (ms early at the sync point; 0 = straggler)")
    fig.colorbar(im, ax=ax, label="lead ms")
    _mark_episodes(ax, a, diagnosis, digest)
    return fig


def _stragglers_plot(
    plt: Any, a: RunLines, cfg: DiagnosisConfig, diagnosis: Diagnosis, digest: RunDigest
) -> Any:
    counts = np.bincount(digest.straggler, minlength=a.world_size) / max(a.steps, 1)
    fig, ax = plt.subplots(figsize=(9, 3))
    if a.world_size > cfg.max_heatmap_rows:
        nodes = [str(n) for n in a.topology("node_rank")]
        per_node: dict[str, float] = {}
        for r in range(a.world_size):
            per_node[nodes[r]] = per_node.get(nodes[r], 0.0) + counts[r]
        index_bars(ax, list(per_node.values()), "node")
    else:
        index_bars(ax, counts.tolist(), "rank")
    ax.set_ylabel("share of steps last")
    ax.set_title("How often each rank was the straggler")
    return fig


def _step_time_plot(
    plt: Any, a: RunLines, cfg: DiagnosisConfig, diagnosis: Diagnosis, digest: RunDigest
) -> Any:
    fig, ax = plt.subplots(figsize=(9, 3))
    paced = a.pacing_active
    bins = np.linspace(np.percentile(a.step_ms, 0.5), np.percentile(a.step_ms, 99.5), 60).tolist()
    ax.hist(a.step_ms[~paced], bins=bins, alpha=0.7, label=f"unpaced ({int((~paced).sum())} steps)")
    if paced.any():
        ax.hist(a.step_ms[paced], bins=bins, alpha=0.7, label=f"paced ({int(paced.sum())} steps)")
    ax.set_xlabel("step time (ms)")
    ax.set_ylabel("steps")
    ax.set_title("Step-time distribution with and without pacing")
    ax.legend()
    return fig


def _delays_plot(plt: Any, a: RunLines, cfg: DiagnosisConfig, diagnosis: Diagnosis, digest: RunDigest) -> Any:
    idx, dl = _bin_steps(a.step_delay_max, cfg.max_heatmap_columns)
    fig, ax = plt.subplots(figsize=(9, 2.6))
    ax.plot(a.step[idx], dl, lw=0.8, color="tab:red")
    ax.set_xlabel("step")
    ax.set_ylabel("ms")
    ax.set_title("Largest pacing delay applied per step")
    return fig


def _projection_plot(
    plt: Any, a: RunLines, cfg: DiagnosisConfig, diagnosis: Diagnosis, digest: RunDigest
) -> Any:
    projected = [f for f in diagnosis.findings if f.projection]
    if not projected:
        return None
    fig, ax = plt.subplots(figsize=(9, 3.6))
    for f in projected:
        xs = [a.world_size] + [int(p["ranks"]) for p in f.projection]
        ys = [100 * f.lost_step_fraction] + [100 * float(p["lost_fraction"]) for p in f.projection]
        where = f" (ranks {', '.join(map(str, f.ranks))})" if f.ranks and len(f.ranks) <= 4 else ""
        (line,) = ax.plot(xs[1:], ys[1:], marker="o", lw=1.2, label=f"{f.mode}{where}")
        ax.plot(xs[:1], ys[:1], marker="s", ms=8, color=line.get_color(), ls="none")
    ax.set_xscale("log", base=2)
    ticks = sorted({a.world_size, *(int(p["ranks"]) for f in projected for p in f.projection)})
    ax.set_xticks(ticks, [f"{t:,}" for t in ticks])
    ax.minorticks_off()
    ax.set_ylim(bottom=0)
    ax.set_xlabel("ranks (square: measured at the recorded size; circles: simulated)")
    ax.set_ylabel("% of step time")
    ax.set_title("What each finding would cost at scale (simulator calibrated on this run)")
    ax.legend(fontsize=8)
    return fig


def _at_scale(f: Any) -> str:
    return projection_text(f.projection) if f.projection else "-"


def _assumption(diagnosis: Diagnosis) -> str:
    p = diagnosis.projection
    if not p:
        return ""
    return (
        f"At scale: simulated, {p['simulated_steps']} steps per size, calibrated on "
        f"{p['calibration_steps']:,} recorded steps (at the recorded size it gives "
        f"{p['simulated_lost_fraction']:.1%} waiting against {p['measured_lost_fraction']:.1%} measured); "
        f"assuming {p['assumption']}."
    )


def render_report(
    a: RunLines,
    diagnosis: Diagnosis,
    out_dir: Path,
    cfg: DiagnosisConfig,
    digest: RunDigest | None = None,
) -> dict[str, Path]:
    """Write the PNG plots, ``report.html`` (self-contained) and ``report.md`` into ``out_dir``.

    ``digest``: the digest of every step of ``a`` (:func:`~pace_strategy.diagnose.findings.
    diagnose_run` gives it); without it, or of fewer steps (a rebalanced run diagnosed at its kept
    split), the run's per-rank numbers are read again."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if digest is None or digest.steps != a.steps:
        digest = digest_run(a, cfg)
    figures = _figures(a, cfg, diagnosis, digest)
    paths: dict[str, Path] = {}
    for name, png in figures.items():
        path = out_dir / f"{name}.png"
        path.write_bytes(png)
        paths[name] = path
    rows = "".join(
        f"<tr><td><b>{html.escape(f.mode.value)}</b></td>"
        f"<td>{html.escape(', '.join(map(str, f.ranks)) or '-')}</td>"
        f"<td>{html.escape(', '.join(f.hosts) or '-')}</td><td>{f.confidence:.2f}</td>"
        f"<td>{f.lost_step_fraction:.1%}</td><td>{html.escape(_at_scale(f))}</td>"
        f"<td>{html.escape(f.evidence)}</td><td>{html.escape(f.action)}</td></tr>"
        for f in diagnosis.findings
    )
    assumption = _assumption(diagnosis)
    # said where the plots would be, so that a report without them is not taken for a run without data
    no_plots = (
        ""
        if importlib.util.find_spec("matplotlib")
        else str(extra_error("Drawing the plots", ["matplotlib"]))
    )
    images = "".join(
        f'<h3>{name.replace("_", " ")}</h3><img alt="{name}" src="data:image/png;base64,'
        f'{base64.b64encode(png).decode()}">'
        for name, png in figures.items()
    )
    notes = "".join(f"<li>{html.escape(n)}</li>" for n in diagnosis.notes)
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>pace diagnose: {html.escape(str(a.path.parent))}</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:2em auto}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;vertical-align:top}}img{{max-width:100%}}</style></head><body>
<h1>pace diagnose</h1>
<p>Run record <code>{html.escape(str(a.path))}</code>: {a.world_size} ranks, {a.steps:,} usable steps
(of {a.total_steps:,}).</p>
<h2>Summary</h2><p>{html.escape(diagnosis.summary)}</p>
{f"<ul>{notes}</ul>" if notes else ""}
<h2>Findings</h2>
<table><tr><th>mode</th><th>ranks</th><th>hosts</th><th>confidence</th><th>lost step time</th>
<th>at scale</th><th>evidence</th><th>action</th></tr>{rows}</table>
{f"<p><i>{html.escape(assumption)}</i></p>" if assumption else ""}
<h2>Plots</h2>{images}{f"<p>{html.escape(no_plots)}</p>" if no_plots else ""}
<h2>Thresholds used</h2><pre>{html.escape(json.dumps(diagnosis.thresholds, indent=2))}</pre>
</body></html>
"""
    paths["html"] = out_dir / "report.html"
    paths["html"].write_text(page, encoding="utf-8")
    md = [f"# pace diagnose\n\nRun record `{a.path}`: {a.world_size} ranks, {a.steps:,} usable steps.\n"]
    md.append(f"## Summary\n\n{diagnosis.summary}\n")
    md += [f"- note: {n}" for n in diagnosis.notes]
    md.append("\n## Findings\n")
    md.append("| mode | ranks | hosts | confidence | lost step time | at scale | evidence | action |")
    md.append("|---|---|---|---|---|---|---|---|")
    for f in diagnosis.findings:
        md.append(
            f"| {f.mode} | {', '.join(map(str, f.ranks)) or '-'} | {', '.join(f.hosts) or '-'} | "
            f"{f.confidence:.2f} | {f.lost_step_fraction:.1%} | {_at_scale(f)} | {f.evidence} | {f.action} |"
        )
    if assumption:
        md.append(f"\n_{assumption}_")
    md.append("\n## Plots\n")
    md += [f"![{name}]({name}.png)" for name in figures] + ([no_plots] if no_plots else [])
    md.append("\n## Thresholds used\n\n```json\n" + json.dumps(diagnosis.thresholds, indent=2) + "\n```\n")
    paths["markdown"] = out_dir / "report.md"
    paths["markdown"].write_text("\n".join(md), encoding="utf-8")
    return paths
