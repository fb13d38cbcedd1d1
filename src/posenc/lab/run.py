"""One lab run: train each scheme, evaluate it, extend the RoPE model, fine-tune it, probe retrieval.

`run_lab(cfg, out_dir)` returns the nested results (also what `report` writes):

    {"meta": {...}, "schemes": {scheme: {"key", "train", "eval": {multiple: row}, "probe": [rows]}},
     "extension": {rule label: {"eval": {multiple: row}, "probe": [rows]}}, "longrope_search": {label: {s: {...}}},
     "finetune": {method: {"key", "train", "eval": {multiple: row}}}}

where a `row` is `evaluate.summarize`'s and probe rows are `probe.probe_accuracy`'s with "length" added.
Extension and fine-tuning need "rope" among the schemes; their control (`ref_*`) is the un-scaled
pre-trained RoPE model's in-window NLL on the same tokens.
"""

from __future__ import annotations

import os
import pathlib
import platform
import time

import torch

from ..rope.spec import Rope
from .config import LabConfig, train_key
from .data import eval_windows, load_corpus
from .evaluate import control_nll, summarize, token_nll
from .extension import finetune_scaling, parse_rule
from .longrope import search_budget, search_factors
from .probe import probe_accuracy
from .progress import bar, log
from .schemes import build_model, with_rope
from .train import Schedule, fit

__all__ = ["run_lab"]


def _probe(cfg: LabConfig, model, stream, multiple: int, block=None) -> list[dict]:
    rows = probe_accuracy(model, stream, multiple * cfg.l0, cfg.probe_depths, run=cfg.probe_run, cue=cfg.probe_cue,
                          trials=cfg.probe_trials, seed=cfg.seed + multiple, batch=cfg.eval_batch, block=block)
    return [dict(row, length=multiple * cfg.l0, multiple=multiple) for row in rows]


def _schedule(cfg: LabConfig, **changes) -> Schedule:
    base = dict(steps=cfg.steps, batch_size=cfg.batch_size, length=cfg.l0, lr=cfg.lr, warmup=cfg.warmup,
                min_ratio=cfg.min_lr_ratio, grad_clip=cfg.grad_clip, seed=cfg.seed)
    return Schedule(**{**base, **changes})


def run_lab(cfg: LabConfig, out_dir: str | os.PathLike) -> dict:
    """Run every stage of `cfg`, reusing finished checkpoints under `out_dir/checkpoints`."""
    out = pathlib.Path(out_dir)
    checkpoints = out / "checkpoints"
    started = time.perf_counter()
    corpus = load_corpus(cfg.corpus)
    windows = eval_windows(corpus.val, cfg.eval_windows, cfg.max_length)  # [n, max_length + 1]
    meta = dict(config=cfg.to_dict(), corpus=corpus.describe(), python=platform.python_version(),
                torch=torch.__version__, threads=torch.get_num_threads(), machine=platform.machine(),
                load_average_start=list(os.getloadavg()), timings={})
    results: dict = dict(meta=meta, schemes={}, extension={}, longrope_search={}, finetune={})
    multiples = cfg.lengths
    models, refs = {}, {}
    for scheme in cfg.schemes:
        t0 = time.perf_counter()
        model = build_model(cfg, scheme)
        key = train_key(cfg, scheme, corpus.sha256)
        record = fit(model, corpus.train, _schedule(cfg), checkpoints / f"{scheme}-{key}.pt", label=f"train {scheme}")
        with bar(f"eval {scheme}", 2 + len(multiples)) as tick:
            nll = token_nll(model, windows, batch=cfg.eval_batch)
            tick()
            refs[scheme] = control_nll(model, windows, cfg.l0, batch=cfg.eval_batch)
            tick()
            probe = []
            for m in multiples:
                probe += _probe(cfg, model, corpus.val, m)
                tick()
        results["schemes"][scheme] = dict(key=key, train=record, eval=summarize(nll, refs[scheme], cfg.l0, multiples),
                                          probe=probe)
        models[scheme] = model
        meta["timings"][scheme] = time.perf_counter() - t0
        log(f"{scheme}: final train loss {record['final_loss']:.3f}, ppl@L0 {results['schemes'][scheme]['eval'][1]['ppl_all']:.3f}")
    if "rope" in models:
        t0 = time.perf_counter()
        _extend(cfg, models["rope"], refs["rope"], windows, corpus, results)
        meta["timings"]["extension"] = time.perf_counter() - t0
        if cfg.finetune_steps and cfg.finetune_methods:
            t0 = time.perf_counter()
            _finetune(cfg, models["rope"], refs["rope"], windows, corpus, checkpoints, results)
            meta["timings"]["finetune"] = time.perf_counter() - t0
    meta["timings"]["total"] = time.perf_counter() - started
    meta["load_average_end"] = list(os.getloadavg())
    return results


def _rope_with(model, scaling) -> Rope:
    return Rope(head_dim=model.rope.head_dim, base=model.rope.base, scaling=scaling)


def _extend(cfg: LabConfig, model, ref: torch.Tensor, windows: torch.Tensor, corpus, results: dict) -> None:
    """Zero-shot rules at every length, LongRoPE searched per scale, the probe under each rule."""
    rules = [parse_rule(spec, cfg.longrope_factors) for spec in cfg.rules]
    search_windows = eval_windows(corpus.train, cfg.search_windows, cfg.max_length)  # train split only
    multiples = cfg.lengths
    searched = sum(rule.searched for rule in rules) * (len(multiples) - 1)
    total = len(rules) * 2 * len(multiples) + searched * search_budget(cfg.search_population, cfg.search_generations)
    with bar("extension rules", total) as tick:
        for rule in rules:
            block = rule.block(cfg.l0)
            evals, probe = {}, []
            if rule.length_free:
                variant = with_rope(model, _rope_with(model, rule.scaling(1, cfg.l0)))
                nll = token_nll(variant, windows, batch=cfg.eval_batch, block=block)
                evals = summarize(nll, ref, cfg.l0, multiples)
                tick(len(multiples))
            for m in multiples:
                if not rule.length_free:
                    factors = None
                    if rule.searched:
                        factors = tuple([1.0] * (model.rope.rotary_dim // 2))  # at L0 LongRoPE uses its short factors
                        if m > 1:
                            found = search_factors(model, rule, m, cfg.l0, search_windows[:, :m * cfg.l0 + 1],
                                                   population=cfg.search_population,
                                                   generations=cfg.search_generations, seed=cfg.seed + m,
                                                   batch=cfg.eval_batch, tick=tick)
                            results["longrope_search"].setdefault(rule.label, {})[m] = found
                            factors = tuple(found["factors"])
                    variant = with_rope(model, _rope_with(model, rule.scaling(m, cfg.l0, factors)))
                    nll = token_nll(variant, windows[:, :m * cfg.l0 + 1], batch=cfg.eval_batch, block=block)
                    evals[m] = summarize(nll, ref, cfg.l0, (m,))[m]
                    tick()
                else:
                    variant = with_rope(model, _rope_with(model, rule.scaling(m, cfg.l0)))
                probe += _probe(cfg, variant, corpus.val, m, block)
                tick(info=rule.label)
            results["extension"][rule.label] = dict(rule=rule.name, knobs=dict(rule.knobs), eval=evals, probe=probe)


def _finetune(cfg: LabConfig, model, ref, windows, corpus, checkpoints: pathlib.Path, results: dict) -> None:
    """A few steps at 2 L0 with each method's static scale s = 2, then evaluation at every length."""
    for method in cfg.finetune_methods:
        scaling = finetune_scaling(method, cfg.l0, 2)
        variant = with_rope(model, _rope_with(model, scaling))
        key = train_key(cfg, "rope", results["meta"]["corpus"]["sha256"], finetune=method, ft_steps=cfg.finetune_steps,
                        ft_lr=cfg.finetune_lr, ft_scaling=repr(scaling))
        schedule = _schedule(cfg, steps=cfg.finetune_steps, batch_size=max(1, cfg.batch_size // 2), length=2 * cfg.l0,
                             lr=cfg.finetune_lr, warmup=min(5, cfg.finetune_steps), min_ratio=1.0, seed=cfg.seed + 1)
        record = fit(variant, corpus.train, schedule, checkpoints / f"finetune-{method}-{key}.pt",
                     label=f"fine-tune {method}")
        nll = token_nll(variant, windows, batch=cfg.eval_batch)
        results["finetune"][method] = dict(key=key, scaling=repr(scaling), train=record,
                                           eval=summarize(nll, ref, cfg.l0, cfg.lengths))
