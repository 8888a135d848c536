"""Train a Qwen2-VL, VideoMAE or Wan model with Hugging Face Accelerate on Helix.

    accelerate launch --multi_gpu --num_processes 2 recipes/train_accelerate.py --config configs/videomae_kinetics_mixed.yaml

It reads the same YAML as ``train_lightning.py`` (``model``, ``data`` and, of ``trainer``,
``max_steps``, ``max_epochs``, ``accumulate_grad_batches``, ``log_every_n_steps``); the launcher
decides the processes. On a machine without a GPU it builds ``Accelerator(cpu=True)``, so that
``--multi_gpu --num_processes 2`` runs two gloo processes. ``--checkpoint-every N`` saves
``accelerator.save_state`` to ``OUTPUT/step_<N>`` (model, optimizer, RNG, loader position);
``--resume DIR`` continues from one, exactly where the loader stood.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``recipes`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import yaml

from helix_lightning import HelixAcceleratePlugin
from helix_lightning.data import DatasetConfig
from recipes.models import build_model
from recipes.specs import check_families

__all__ = ["load_config", "main"]

_SECTIONS = {
    "model": {"family", "pretrained", "config", "lr", "weight_decay"},
    "data": {"dataset", "batch_size", "val_dataset", "synth", "coordinator", "loader", "loader_options"},
}
_TRAINER_KEYS = {"max_steps", "max_epochs", "accumulate_grad_batches", "log_every_n_steps"}


def load_config(path: str) -> dict:
    """The YAML's ``model``, ``data`` and ``trainer`` sections, checked key by key (a trainer key
    Accelerate has no use for, like ``devices``, is ignored: the launcher decides)."""
    with open(path) as f:
        cfg = yaml.safe_load(f) or {}
    for section, valid in _SECTIONS.items():
        for key in cfg.get(section) or {}:
            if key not in valid:
                raise ValueError(f"{path}: unknown key {section}.{key}; valid: {', '.join(sorted(valid))}")
    model, data = dict(cfg.get("model") or {}), dict(cfg.get("data") or {})
    trainer = {k: v for k, v in (cfg.get("trainer") or {}).items() if k in _TRAINER_KEYS}
    if "dataset" not in data or "batch_size" not in data:
        raise ValueError(f"{path}: data.dataset and data.batch_size are required")
    DatasetConfig(data["dataset"], "data.dataset")  # checked here, before any process waits on another
    return {"model": model, "data": data, "trainer": trainer}


class TrainState:
    """The step counter, saved and restored with the accelerator's state."""

    def __init__(self):
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--output-dir", default="helix-accelerate-out", help="checkpoints and traces")
    p.add_argument("--max-steps", type=int, default=None, help="overrides trainer.max_steps")
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--resume", default=None, help="a folder written by --checkpoint-every")
    p.add_argument("--trace", action="store_true", help="write each rank's batches to OUTPUT/trace-rank<r>.jsonl")
    p.add_argument("--fail-after-step", type=int, default=None, help="simulate a crash (for resume tests)")
    p.add_argument("--warmup", type=int, default=0, help="steps left out of the summary's steps/s and input wait")
    p.add_argument("--summary", default=None, help="the main process writes the run's summary here (JSON)")
    a = p.parse_args(argv)
    cfg = load_config(a.config)
    model_cfg, data, trainer = cfg["model"], cfg["data"], cfg["trainer"]
    check_families(model_cfg.get("family", "videomae"), {k: data.get(k) for k in ("dataset", "val_dataset")})
    model = build_model(
        model_cfg.get("family", "videomae"), pretrained=model_cfg.get("pretrained"), **(model_cfg.get("config") or {})
    )

    from accelerate import Accelerator  # after the checks: a bad config fails fast

    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),
        gradient_accumulation_steps=int(trainer.get("accumulate_grad_batches", 1)),
        log_with=None,
    )
    plugin = HelixAcceleratePlugin(
        coordinator=data.get("coordinator"), loader=data.get("loader", "helix"), **(data.get("loader_options") or {})
    )
    loader = plugin.prepare(accelerator, data["dataset"], int(data["batch_size"]))
    params = [q for q in model.parameters() if q.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=float(model_cfg.get("lr", 1e-4)), weight_decay=float(model_cfg.get("weight_decay", 0.01))
    )
    model, optimizer = accelerator.prepare(model, optimizer)
    state = TrainState()
    accelerator.register_for_checkpointing(state)
    if a.resume:
        accelerator.load_state(a.resume)
    out = Path(a.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    trace = (out / f"trace-rank{accelerator.process_index}.jsonl").open("a") if a.trace else None
    max_steps = a.max_steps if a.max_steps is not None else int(trainer.get("max_steps", -1))
    max_epochs = int(trainer.get("max_epochs", -1) or -1)
    log_every = int(trainer.get("log_every_n_steps", 50))
    waits_before = 0
    t0, first_step = time.perf_counter(), state.step + a.warmup
    try:
        epoch = loader.start_epoch  # a state saved at an epoch's end resumes at the next epoch
        while (max_epochs < 0 or epoch < max_epochs) and (max_steps < 0 or state.step < max_steps):
            loader.set_epoch(epoch)  # the epoch a resumed loader stands in keeps its position
            for batch in loader:
                if trace is not None:
                    trace.write(
                        json.dumps({"step": state.step, "epoch": epoch, "indices": batch["index"].tolist()}) + "\n"
                    )
                    trace.flush()
                with plugin.step(), accelerator.accumulate(model):
                    loss = model(batch)
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
                state.step += 1
                if state.step == first_step:  # the warm-up ends: the summary counts from here
                    t0, waits_before = time.perf_counter(), len(loader.input_waits)
                if state.step % log_every == 0:
                    metrics = plugin.log(state.step)
                    accelerator.print(
                        f"step {state.step} loss {loss.item():.4f} "
                        + " ".join(f"{k} {v:.3f}" for k, v in metrics.items())
                    )
                if a.checkpoint_every and state.step % a.checkpoint_every == 0:
                    accelerator.save_state(str(out / f"step_{state.step}"))
                if a.fail_after_step is not None and state.step >= a.fail_after_step:
                    raise RuntimeError(f"simulated crash after step {state.step}")
                if 0 <= max_steps <= state.step:
                    break
            epoch += 1
        accelerator.wait_for_everyone()
        elapsed = time.perf_counter() - t0
        steps = max(0, state.step - first_step)
        waits = loader.input_waits[waits_before:] if a.warmup else loader.input_waits
        total = accelerator.gather(torch.tensor([float(sum(waits))], device=accelerator.device))
        summary = {
            "steps": steps,
            "seconds": elapsed,
            "steps_per_s": steps / elapsed if elapsed > 0 else 0.0,
            "input_wait_s_per_step": float(total.max()) / max(steps, 1),  # the slowest rank's
            "loader": data.get("loader", "helix"),
            "processes": accelerator.num_processes,
            **plugin.stats(),
        }
        accelerator.print(json.dumps(summary))
        if a.summary and accelerator.is_main_process:
            Path(a.summary).write_text(json.dumps(summary, indent=1))
        return summary
    finally:
        if trace is not None:
            trace.close()
        for prepared in plugin.loaders:
            if hasattr(prepared, "close"):
                prepared.close()
        # the DDP wrapper (its Reducer holds the gloo group) must die now, before the group is destroyed:
        # left to interpreter teardown, the group's destructor joins gloo's worker thread holding the GIL
        # while that thread needs the GIL to free a finished work's tensor — a hang at exit
        model = optimizer = batch = loss = None
        accelerator.free_memory()
        accelerator.end_training()


if __name__ == "__main__":
    main()
