"""Steps/s and input wait of the recipes with Helix vs a plain torch DataLoader, same CPU budget.

    python recipes/compare_loaders.py configs/*.yaml --steps 30 --warmup 5 --out helix-runs/compare

Each config runs twice under ``accelerate launch --multi_gpu --num_processes N`` (gloo on a CPU
machine; ``--processes 1``: one plain process, e.g. on a machine with one GPU): ``data.loader:
helix`` and ``data.loader: torch`` (``DistributedSampler`` order, the same worker count per host). Prints a table and writes ``compare.md`` / ``compare.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def run_one(config: Path, loader: str, args, out: Path) -> dict:
    cfg = yaml.safe_load(config.read_text())
    cfg["data"]["loader"] = loader
    tmp = out / f"{config.stem}-{loader}.yaml"
    tmp.write_text(yaml.safe_dump(cfg))
    summary = out / f"{config.stem}-{loader}.json"
    multi = ["--multi_gpu"] if args.processes > 1 else []  # one process: a plain (one-GPU or CPU) run
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *multi, "--num_processes", str(args.processes),
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           str(ROOT / "recipes" / "train_accelerate.py"), "--config", str(tmp), "--max-steps",
           str(args.steps + args.warmup), "--warmup", str(args.warmup), "--summary", str(summary),
           "--output-dir", str(out / f"{config.stem}-{loader}")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{config.name} with loader={loader} failed:\n{proc.stderr[-3000:]}")
    return json.loads(summary.read_text())


def main(argv=None) -> list[dict]:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("configs", nargs="+", type=Path)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("helix-runs/compare"))
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    with Progress() as bar:
        task = bar.add_task("recipes", total=2 * len(args.configs))
        for config in args.configs:
            r = {"config": config.stem}
            for loader in ("torch", "helix"):
                s = run_one(config, loader, args, args.out)
                r[f"{loader}_steps_per_s"], r[f"{loader}_input_wait_s"] = s["steps_per_s"], s["input_wait_s_per_step"]
                bar.advance(task)
            r["speedup"] = r["helix_steps_per_s"] / r["torch_steps_per_s"]
            rows.append(r)
    table = Table(title=f"recipes: {args.steps} steps after {args.warmup} warm-up, {args.processes} processes")
    cols = ("config", "torch_steps_per_s", "helix_steps_per_s", "speedup", "torch_input_wait_s", "helix_input_wait_s")
    for c in cols:
        table.add_column(c)
    for r in rows:
        table.add_row(*[r[c] if isinstance(r[c], str) else f"{r[c]:.3f}" for c in cols])
    Console().print(table)
    md = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(r[c] if isinstance(r[c], str) else f"{r[c]:.3f}" for c in cols) + " |" for r in rows]
    (args.out / "compare.md").write_text("\n".join(md) + "\n\ninput wait: seconds per step blocked in next(), "
                                         "the slowest rank\n")
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
    for ax, key, title in ((axes[0], "steps_per_s", "training steps/s"),
                           (axes[1], "input_wait_s", "input wait per step, s (slowest rank)")):
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
