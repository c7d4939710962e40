"""Stage: pre-train the embedded shapes backbone from scratch (resumable, with a progress bar).

Reads the train prompt split, runs `cast_core.shapes.pretrain` steps, and every `save_every` steps
writes a resumable training state (weights, EMA, AdamW moments: safetensors; step and config: JSON)
under `work_dir`, atomically. At the end the EMA weights are saved with `save_pretrained` to `out_dir`
together with `training.json` (config, steps, wall time, loss curve).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

import torch
from prefect import task
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from cast_core.backbones.shapes import ShapesBackbone, ShapesBackboneConfig
from cast_core.shapes.pretrain import (
    PretrainConfig,
    ema_update,
    make_batch,
    make_optimizer,
    tag_probabilities,
    train_step,
)
from cast_core.shapes.prompts import load_prompt_file


def _save_state(work_dir: Path, step: int, model, ema, optimizer, losses: list[float],
                segments: list[dict]) -> None:
    tensors = {f"model.{k}": v.contiguous() for k, v in model.state_dict().items()}
    tensors |= {f"ema.{k}": v.contiguous() for k, v in ema.state_dict().items()}
    opt = optimizer.state_dict()
    for idx, state in opt["state"].items():
        for name, value in state.items():
            tensors[f"opt.{idx}.{name}"] = torch.as_tensor(value).contiguous()
    tmp = work_dir / "state.tmp"
    save_file(tensors, str(tmp))
    meta = {"step": step, "param_groups": opt["param_groups"], "losses": losses,
            "segments": segments}
    (work_dir / "state.json.tmp").write_text(json.dumps(meta))
    os.replace(tmp, work_dir / "state.safetensors")
    os.replace(work_dir / "state.json.tmp", work_dir / "state.json")  # completion recorded last


def _load_state(work_dir: Path, model, ema, optimizer) -> tuple[int, list[float], list[dict]]:
    meta_path = work_dir / "state.json"
    if not meta_path.exists():
        return 0, [], []
    meta = json.loads(meta_path.read_text())
    tensors = load_file(str(work_dir / "state.safetensors"))
    model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
    ema.load_state_dict({k[4:]: v for k, v in tensors.items() if k.startswith("ema.")})
    state: dict[int, dict] = defaultdict(dict)
    for key, value in tensors.items():
        if key.startswith("opt."):
            _, idx, name = key.split(".", 2)
            state[int(idx)][name] = value
    optimizer.load_state_dict({"state": dict(state), "param_groups": meta["param_groups"]})
    segments = meta.get("segments") or [{"from_step": 0, "to_step": int(meta["step"]),
                                         "schedule_steps": None, "wall_seconds": None}]
    return int(meta["step"]), list(meta["losses"]), segments


def _save_snapshot(path: Path, ema: ShapesBackbone) -> None:
    staging = path.with_name(path.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    ema.save_pretrained(staging)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(staging, path)


def pretrain_shapes(train_file: str, out_dir: str, work_dir: str, config: PretrainConfig,
                    model_config: ShapesBackboneConfig, save_every: int = 250,
                    threads: int | None = None, stop_after: int | None = None,
                    init_from: str | None = None, snapshot_every: int | None = None) -> dict:
    """Train (or resume) and save the EMA backbone to out_dir. Returns a small summary dict.

    `stop_after` ends the run after that step's state is saved (a multiple of save_every), without
    writing out_dir: a later call resumes from there, possibly with a different `config.steps`.
    `init_from` starts from the weights of a saved shapes backbone (continued training, fresh
    optimiser and schedule; its model config wins over `model_config`) instead of random ones.
    `snapshot_every` also saves the EMA weights as a loadable backbone folder
    `work_dir/ema-<step>` every that many steps, so intermediate models can be evaluated and the
    best one kept (see `flows.base_eval --checkpoint`).
    """
    if threads:
        torch.set_num_threads(threads)
    records = load_prompt_file(train_file)
    by_tag: dict[str, list[dict]] = defaultdict(list)
    for record in records:
        by_tag[record["tag"]].append(record)
    tag_probabilities(sorted(by_tag), config)  # a typo in tag_weights fails here, not mid-run
    torch.manual_seed(config.seed)
    model = ShapesBackbone.from_pretrained(init_from) if init_from else ShapesBackbone(model_config)
    model_config = model.config
    ema = ShapesBackbone(model_config, tokenizer=model.tokenizer)
    ema.load_state_dict(model.state_dict())
    ema.requires_grad_(False)
    optimizer = make_optimizer(model, config)
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    start, losses, done_segments = _load_state(work, model, ema, optimizer)
    started = time.time()
    end = min(config.steps, stop_after or config.steps)
    bar = tqdm(range(start, end), initial=start, total=config.steps, desc="pretrain",
               dynamic_ncols=True, mininterval=2.0)
    for step in bar:
        loss, grad_norm = train_step(model, optimizer, make_batch(by_tag, config, step), config, step)
        ema_update(ema, model, config.ema_decay if step >= config.warmup_steps else 0.0)
        losses.append(round(loss, 5))
        bar.set_postfix(loss=f"{sum(losses[-50:]) / len(losses[-50:]):.4f}",
                        lr=f"{config.lr_at(step):.1e}", gnorm=f"{grad_norm:.2f}")
        if (step + 1) % save_every == 0 or step + 1 in (config.steps, end):
            segment = {"from_step": start, "to_step": step + 1, "schedule_steps": config.steps,
                       "wall_seconds": round(time.time() - started, 1)}
            _save_state(work, step + 1, model, ema, optimizer, losses, done_segments + [segment])
        if snapshot_every and (step + 1) % snapshot_every == 0:
            _save_snapshot(work / f"ema-{step + 1}", ema)
    if end < config.steps:
        return {"work_dir": str(work), "stopped_at": end, "final_loss": losses[-1]}
    out = Path(out_dir)
    staging = out.with_name(out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    ema.save_pretrained(staging)
    history = json.loads((work / "state.json").read_text())["segments"]
    summary = {"config": asdict(config), "model_config": asdict(model_config), "segments": history,
               "init_from": init_from,
               "parameters": sum(p.numel() for p in ema.parameters()),
               "wall_seconds_this_run": round(time.time() - started, 1),
               "resumed_from_step": start, "loss_every_50": losses[::50]}
    (staging / "training.json").write_text(json.dumps(summary, indent=1) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(staging, out)
    return {"out_dir": str(out), "steps": config.steps, "final_loss": losses[-1]}


pretrain_shapes_task = task(pretrain_shapes, name="pretrain-shapes")
