"""Steps/s and input wait of the recipes with Helix vs a plain torch DataLoader, same CPU budget.

    python recipes/compare_loaders.py configs/*.yaml --repeats 3 --out helix-runs/compare

Each config runs twice per repeat under ``accelerate launch --multi_gpu --num_processes N`` (gloo on a CPU
machine; ``--processes 1``: one plain process, e.g. on a machine with one GPU): ``data.loader:
helix`` and ``data.loader: torch`` (``DistributedSampler`` order, the same worker count per host), the two in turn and in
alternating order (torch first, then helix first, ...): the machine's speed drifts, so each
config's figure is the median of its repeats' helix / torch ratios. Prints a table and writes
``compare.md`` / ``compare.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def run_one(config: Path, loader: str, args, out: Path) -> dict:
    cfg = yaml.safe_load(config.read_text())
    cfg["data"]["loader"] = loader
    if loader == "torch" and args.torch_worker_nice:
        cfg["data"].setdefault("loader_options", {})["worker_nice"] = args.torch_worker_nice
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f"{config.stem}-{loader}.yaml"
    tmp.write_text(yaml.safe_dump(cfg))
    summary = out / f"{config.stem}-{loader}.json"
    multi = ["--multi_gpu"] if args.processes > 1 else []  # one process: a plain (one-GPU or CPU) run
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        *multi,
        "--num_processes",
        str(args.processes),
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        str(ROOT / "recipes" / "train_accelerate.py"),
        "--config",
        str(tmp),
        "--max-steps",
        str(args.steps + args.warmup),
        "--warmup",
        str(args.warmup),
        "--summary",
        str(summary),
        "--output-dir",
        str(out / f"{config.stem}-{loader}"),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{config.name} with loader={loader} failed:\n{proc.stderr[-3000:]}")
    return json.loads(summary.read_text())


LOADERS = ("torch", "helix")


def order(repeat: int) -> tuple[str, str]:
    """The loaders of repeat ``repeat`` in the order they run: torch first on even repeats."""
    return LOADERS if repeat % 2 == 0 else LOADERS[::-1]


def summarise(config: str, pairs: list[dict]) -> dict:
    """One config's row from its repeats (``{loader: summary}`` each): medians of steps/s and input
    wait per loader, and the median of the per-repeat helix / torch ratios (``speedup``)."""
    row = {"config": config, "repeats": len(pairs)}
    for loader in LOADERS:
        row[f"{loader}_steps_per_s"] = statistics.median(p[loader]["steps_per_s"] for p in pairs)
        row[f"{loader}_input_wait_s"] = statistics.median(p[loader]["input_wait_s_per_step"] for p in pairs)
    row["speedups"] = [p["helix"]["steps_per_s"] / p["torch"]["steps_per_s"] for p in pairs]
    row["speedup"] = statistics.median(row["speedups"])
    return row


def main(argv=None) -> list[dict]:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("configs", nargs="+", type=Path)
    p.add_argument("--steps", type=int, default=150, help="measured steps (shorter windows swing with the machine)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1, help="pairs per config, in alternating order")
    p.add_argument("--out", type=Path, default=Path("helix-runs/compare"))
    p.add_argument(
        "--torch-worker-nice",
        type=int,
        default=0,
        help="torch's workers at this added niceness, as Helix's decoding workers run (default 0: a plain "
        "DataLoader); shows how much of a gain is the scheduling priority",
    )
    args = p.parse_args(argv)
    if args.repeats < 1 or args.steps < 1 or args.warmup < 0:
        p.error("--repeats and --steps must be >= 1, --warmup >= 0")
    if not 0 <= args.torch_worker_nice <= 19:
        p.error(f"--torch-worker-nice is a niceness in 0..19, got {args.torch_worker_nice}")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    with Progress() as bar:
        task = bar.add_task("recipes", total=2 * len(args.configs) * args.repeats)
        for config in args.configs:
            pairs = []
            for repeat in range(args.repeats):
                pair = {}
                for loader in order(repeat):
                    pair[loader] = run_one(config, loader, args, args.out / f"r{repeat}")
                    bar.advance(task)
                pairs.append(pair)
            rows.append(summarise(config.stem, pairs))
    niced = f", torch's workers at niceness +{args.torch_worker_nice}" if args.torch_worker_nice else ""
    table = Table(
        title=f"recipes: {args.steps} steps after {args.warmup} warm-up, {args.processes} processes, "
        f"median of {args.repeats} pair(s){niced}"
    )
    cols = (
        "config",
        "torch_steps_per_s",
        "helix_steps_per_s",
        "speedup",
        "speedups",
        "torch_input_wait_s",
        "helix_input_wait_s",
    )

    def cell(v) -> str:
        return v if isinstance(v, str) else " / ".join(f"{x:.3f}" for x in v) if isinstance(v, list) else f"{v:.3f}"

    for c in cols:
        table.add_column(c)
    for r in rows:
        table.add_row(*[cell(r[c]) for c in cols])
    Console().print(table)
    md = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(cell(r[c]) for c in cols) + " |" for r in rows]
    (args.out / "compare.md").write_text(
        "\n".join(md) + "\n\ninput wait: seconds per step blocked in next(), the slowest rank\n"
    )
    (args.out / "compare.json").write_text(json.dumps(rows, indent=1))
    picture(rows, args.out / "compare.png")
    Console().print(f"table, JSON and picture in {args.out}")
    return rows


def picture(rows: list[dict], path: Path) -> None:
    """Steps/s and input wait per step, torch vs Helix, one pair of bars per config."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), layout="constrained")
    xs = range(len(rows))
    for ax, key, title in (
        (axes[0], "steps_per_s", "training steps/s"),
        (axes[1], "input_wait_s", "input wait per step, s (slowest rank)"),
    ):
        for k, loader in enumerate(("torch", "helix")):
            ax.bar([x + 0.4 * k - 0.2 for x in xs], [r[f"{loader}_{key}"] for r in rows], 0.4, label=loader)
        ax.set_xticks(list(xs), [r["config"] for r in rows], fontsize="small", rotation=10)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize="small")
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
