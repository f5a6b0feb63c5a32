"""The trainer of VLRetrievalModel (BE, CE or JOIN); its CLI is ``python -m retrieval_core.training.train``.

Recipe (paper / MMT-Retrieval): AdamW (weight decay 0.05, none on biases and LayerNorm weights), linear decay
without warmup, gradient clipping at 1.0. JOIN alternates objectives on shared weights: every step does a BE
forward/backward/optimizer step and then a CE one. BE: batch-hard triplet (margin 0.1) or InfoNCE on one row per
caption. CE: per caption one positive and one sampled negative (image replaced with p=0.5, else caption).

Determinism and resume: every source of randomness of step ``s`` (caption order, CE negatives, dropout) is
seeded from (seed, s) alone, so a run resumed from ``output/last/`` continues exactly like an uninterrupted one
(CPU; CUDA kernels may not be bit-reproducible). The trainer state (step, best metric, AdamW moments) is
stored as safetensors + JSON, never as a pickle.

Reads: the regions of the images a step uses are read while the step before it runs (``collate.prefetched``, one
worker thread; what is known then: the step's batch, and its CE groups unless that step or the one before it mines
negatives first, with the model as trained then: the CE reads of two steps per mining are made on their path), from
the split's images as TrainData holds them: one in-memory table, or a region file read by position
(``train_data.choose_train_source``).

Output folder: ``last/`` (model + trainer_state.*), ``best/`` (model with the best dev metric + eval.json),
``train_log.jsonl`` (one line per objective step and per evaluation).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from dataclasses import asdict
from typing import Optional

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from retrieval_core.memory import trim_heap
from retrieval_core.model.collate import Regions, collate_images, collate_pairs, length_chunks, prefetched
from retrieval_core.model.flops import model_flops
from retrieval_core.model.network import WEIGHTS_FILE, VLRetrievalModel, _autocast
from retrieval_core.training.config import TrainConfig
from retrieval_core.training.dev_eval import evaluate
from retrieval_core.training.losses import (
    HardNegatives,
    MinedNegatives,
    batch_hard_triplet_loss,
    ce_listwise_loss,
    ce_pair_loss,
    infonce_loss,
    sample_ce_groups,
)
from retrieval_core.training.model_init import lstsq_image_embedding
from retrieval_core.training.train_data import TrainData, feature_neighbours, mine_be_negatives

#: Steps whose regions are read ahead of the one running: one hides a step's reads behind the step before it.
READ_AHEAD_STEPS = 1
STATE_JSON = "trainer_state.json"
STATE_TENSORS = "trainer_state.safetensors"
LOG_FILE = "train_log.jsonl"
CHECKPOINTS_DIR = "checkpoints"  # keep_checkpoints: one model folder per checkpoint step


def checkpoint_path(output: str, step: int) -> str:
    """Where ``keep_checkpoints`` puts the model of ``step``."""
    return os.path.join(output, CHECKPOINTS_DIR, f"step-{step:06d}")


def kept_checkpoints(output: str) -> list[tuple[int, str]]:
    """(step, folder) of every model kept under ``output`` by ``keep_checkpoints``, by step."""
    root = os.path.join(output, CHECKPOINTS_DIR)
    names = sorted(os.listdir(root)) if os.path.isdir(root) else []
    return [(int(n.split("-", 1)[1]), os.path.join(root, n)) for n in names
            if n.startswith("step-") and not n.endswith((".tmp", ".old"))]


def step_flops(model: VLRetrievalModel, cfg: TrainConfig, text_tokens: float, regions: float,
               images: Optional[float] = None) -> dict[str, float]:
    """Forward + backward FLOPs of one training step per objective (model_flops, training=True) at the given
    average caption tokens and regions: "be" (batch_size captions and ``images`` distinct images, default
    batch_size; the loss's similarity matrix is left out), "ce" (ce_batch_size x (1 + ce_negatives) pairs) and
    "joint" (both). Padding is not counted: it is what the steps waste."""
    images = cfg.batch_size if images is None else images
    be = cfg.batch_size * model_flops(model, "text", text_tokens=text_tokens, training=True) + \
        images * model_flops(model, "image", regions=regions, training=True)
    pairs = (cfg.ce_batch_size or cfg.batch_size) * (1 + cfg.ce_negatives)
    ce = pairs * model_flops(model, "pair", text_tokens, regions, training=True)
    return {"be": be, "ce": ce, "joint": be + ce}


class Trainer:
    def __init__(self, model: VLRetrievalModel, train: TrainData, cfg: TrainConfig, output_dir: str,
                 dev: Optional[TrainData] = None):
        cfg.check()
        if len(np.unique(train.image_pos)) < 2:
            raise ValueError("training needs captions of at least 2 images")
        self.model, self.data, self.cfg, self.out, self.dev = model, train, cfg, output_dir, dev
        self.device = torch.device(cfg.device)
        self.model.to(self.device)
        self.model.bert.embeddings.word_embeddings.weight.requires_grad_(not cfg.freeze_word_embeddings)
        self.collate_text = model.text_collator()
        self.optimizer = self._make_optimizer()
        # the transformer both objectives share (``bert.*``): its gradient norm is logged per step
        self._trunk = [p for n, p in self.model.named_parameters() if n.startswith("bert.")]
        # the CE objective's AdamW: the same one, or its own state over the same weights (cfg.joint_optimizer)
        self.ce_optimizer = self._make_optimizer() if cfg.joint_optimizer == "separate" else self.optimizer
        self.step = 0
        self.best_metric = -1.0
        self.best_eval: Optional[dict] = None
        self._perm_cache: tuple[int, Optional[np.ndarray]] = (-1, None)
        self._pending_logs: list[dict] = []  # records written by steps (mining) for train_log.jsonl
        self._ready: dict[int, Regions] = {}  # image position -> regions read ahead for the running step
        self.hard: Optional[HardNegatives] = None
        if cfg.objective != "be" and cfg.hard_negative_prob > 0:
            # all staged regions: neighbours are a property of the data, not of the model's region cap
            self.hard = HardNegatives(feature_neighbours(train.images, cfg.hard_negative_k), train.image_pos)
            trim_heap()  # each phase's freed holes back to the OS (memory.trim_heap): at COCO train's size the
            # heap otherwise kept ~3 GB of freed start-up, step and mining chunks in the process's memory
        self.mined: Optional[MinedNegatives] = None
        self.mined_until = 0  # the mined negatives cover the CE captions of steps < mined_until
        self.miner: Optional[VLRetrievalModel] = None  # a given BE checkpoint; None: the model being trained
        if cfg.objective != "be" and cfg.mine_model:
            self.miner = VLRetrievalModel.load(cfg.mine_model, device=cfg.device)
        # the moving average of the trained weights (cfg.ema_decay), float32, by parameter name
        self.ema: Optional[dict[str, torch.Tensor]] = None if not cfg.ema_decay else {
            n: p.detach().float().clone() for n, p in self.model.named_parameters() if p.requires_grad}

    # --------------------------------------------------------------------------------- set-up
    def _make_optimizer(self) -> torch.optim.AdamW:
        groups: dict[tuple[bool, bool], list] = {}
        for name, p in self.model.named_parameters():
            if p.requires_grad:
                new_layer = not name.startswith("bert.")  # img_embedding, img_layer_norm, ce_pooler, ce_classifier
                groups.setdefault((new_layer, p.ndim == 1), []).append(p)  # biases and LayerNorm weights are 1-d
        param_groups = [{"params": ps, "weight_decay": 0.0 if no_decay else self.cfg.weight_decay,
                         "lr_mult": self.cfg.new_layers_lr_mult if new_layer else 1.0}
                        for (new_layer, no_decay), ps in sorted(groups.items())]
        # fused: one vectorised kernel per tensor, far faster on CPU than the default per-tensor ops
        # (docs/log/PERFORMANCE-2026-11.md, measurements behind choices in the code)
        return torch.optim.AdamW(param_groups, lr=self.cfg.lr, fused=True)

    def _amp(self):
        if self.device.type == "cpu" and self.cfg.cpu_bf16:
            return torch.autocast(device_type="cpu", dtype=torch.bfloat16)
        return _autocast(self.device, "bf16" if self.cfg.amp else None)

    def _lr_at(self, step: int) -> float:
        return self.cfg.lr * max(0.0, 1.0 - step / self.cfg.steps)  # linear decay, no warmup

    # ------------------------------------------------------------------------------ batches
    def _batch_indices(self, step: int) -> np.ndarray:
        """Caption positions of ``step``: consecutive slices of per-epoch seeded permutations."""
        n, b = len(self.data), self.cfg.batch_size
        out = np.empty(b, dtype=np.int64)
        for j, p in enumerate(range(step * b, step * b + b)):
            epoch = p // n
            if self._perm_cache[0] != epoch:
                self._perm_cache = (epoch, np.random.default_rng([self.cfg.seed, epoch]).permutation(n))
            out[j] = self._perm_cache[1][p % n]
        return out

    def _to_device(self, batch: dict) -> dict:
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def _objectives(self, step: int) -> tuple[str, ...]:
        if self.cfg.objective != "joint":
            return (self.cfg.objective,)
        if step < self.cfg.ce_start_step:
            return ("be",)
        return ("be", "ce") if (step - self.cfg.ce_start_step) % self.cfg.be_every == 0 else ("ce",)

    def _regions(self, positions: np.ndarray) -> list[Regions]:
        """The regions of the images at ``positions``: read ahead for this step, else read now."""
        ready = self._ready
        missing = [int(p) for p in positions if int(p) not in ready]
        if missing:
            ready = {**ready, **dict(zip(missing, self.data.images.read(missing)))}
        return [ready[int(p)] for p in positions]

    def _known_reads(self, step: int) -> np.ndarray:
        """The image positions ``step`` reads that are known READ_AHEAD_STEPS steps before it runs: its BE batch's
        images, and its CE groups' unless a mining comes before them (the miner is the model as trained then)."""
        objectives, caps = self._objectives(step), self._batch_indices(step)
        parts = [self.data.image_pos[caps]] if "be" in objectives else []
        if "ce" in objectives and not any(self._mines_at(s) for s in range(step - READ_AHEAD_STEPS, step + 1)):
            parts.append(self._ce_groups(caps[:self.cfg.ce_batch_size], step)[1].reshape(-1))
        return np.unique(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)

    def _read_ahead(self, start: int, end: int):
        """(step, {image position: regions}) for steps start..end-1, each read in a worker thread while the steps
        before it run; what a step reads is planned here, in the caller's thread, never in the worker."""
        plans = ((step, self._known_reads(step)) for step in range(start, end))
        read = self.data.images.read
        for (step, positions), regions in prefetched(lambda plan: read(plan[1]), plans, depth=READ_AHEAD_STEPS):
            yield step, dict(zip(positions.tolist(), regions))

    def _be_loss(self, caps: np.ndarray) -> torch.Tensor:
        img_pos = self.data.image_pos[caps]
        uniq, inverse = np.unique(img_pos, return_inverse=True)  # encode each image once
        regions = self._regions(uniq)
        texts = [self.data.texts[i] for i in caps]
        with self._amp():
            text = self._by_length_chunks(texts, lambda idx: self.collate_text([texts[i] for i in idx]),
                                          self.model.embed_text)
            imgs = self.model.embed_image(self._to_device(collate_images(regions, self.model.cfg.max_regions)))
        image_emb = imgs.float()[torch.from_numpy(inverse).to(self.device)]
        ids = torch.from_numpy(img_pos).to(self.device)
        if self.cfg.be_loss == "triplet":
            return batch_hard_triplet_loss(text.float(), image_emb, ids, self.cfg.margin)
        return infonce_loss(text.float(), image_emb, ids, self.cfg.temperature)

    def _mines_at(self, step: int) -> bool:
        """Whether the CE objective of ``step`` (re)mines BE negatives before it samples its groups."""
        return step >= 0 and "ce" in self._objectives(step) and bool(self.cfg.mined_negative_prob) and \
            step >= self.mined_until and step >= self.cfg.mine_start_step

    def _mine_if_due(self, step: int) -> None:
        """(Re)mine BE negatives for the CE captions of steps [step, step + mine_every) (to the end for 0): the
        batches are known in advance, so only the captions about to be used are encoded."""
        if not self._mines_at(step):
            return
        end = self.cfg.steps if not self.cfg.mine_every else min(self.cfg.steps, step + self.cfg.mine_every)
        caps = np.concatenate([self._batch_indices(s)[:self.cfg.ce_batch_size] for s in range(step, end)])
        self.mined, record = mine_be_negatives(self.miner or self.model, self.data, caps, self.cfg.mine_k,
                                               self.cfg.mine_pool, self.cfg.seed * 1_000_003 + step,
                                               self.cfg.eval_batch_size, str(self.device))
        self.mined_until = end
        trim_heap()
        self._pending_logs.append({"step": step, "mined": {**record, "until_step": end,
                                                            "miner": self.cfg.mine_model or "current model"}})

    def _ce_groups(self, caps: np.ndarray, step: int) -> tuple[np.ndarray, np.ndarray]:
        """The CE groups of ``step`` (losses.sample_ce_groups): a function of the seed, the step and the negatives
        mined so far."""
        rng = np.random.default_rng([self.cfg.seed, step, 1])
        p_mined = self.cfg.mined_negative_prob if step >= self.cfg.mine_start_step else 0.0
        return sample_ce_groups(rng, caps, self.data.image_pos, len(self.data.images), len(self.data),
                                self.cfg.ce_negatives, self.cfg.p_replace_image, self.hard, self.cfg.hard_negative_prob,
                                self.mined, p_mined)

    def _ce_step_loss(self, caps: np.ndarray, step: int) -> torch.Tensor:
        """The CE loss of ``step`` with its gradient already accumulated (backward run): in one pass, or over
        micro-batches of ``ce_micro_batch`` captions, each weighted by its share of the groups."""
        caps = caps[:self.cfg.ce_batch_size]  # None keeps the whole batch
        self._mine_if_due(step)
        group_caps, group_imgs = self._ce_groups(caps, step)
        size = self.cfg.ce_micro_batch
        self.model.zero_grad(set_to_none=True)
        if not size or size >= len(group_caps):
            loss = self._ce_loss(group_caps, group_imgs)
            loss.backward()
            return loss
        total = torch.zeros((), device=self.device)
        for start in range(0, len(group_caps), size):
            rows = slice(start, start + size)
            part = self._ce_loss(group_caps[rows], group_imgs[rows]) * (len(group_caps[rows]) / len(group_caps))
            part.backward()  # frees this micro-batch's activations before the next one's
            total += part.detach()
        return total

    def _ce_loss(self, group_caps: np.ndarray, group_imgs: np.ndarray) -> torch.Tensor:
        """The CE loss (mean over the groups) of caption groups with their images (rows: gold first)."""
        texts = [self.data.texts[i] for i in group_caps.reshape(-1)]
        regions = self._regions(group_imgs.reshape(-1))
        mr = self.model.cfg.max_regions
        with self._amp():
            logits = self._by_length_chunks(
                texts, lambda idx: collate_pairs(self.collate_text, [texts[i] for i in idx], [regions[i] for i in idx],
                                                 mr), self.model.ce_logits).float()
        if self.cfg.ce_loss == "listwise":
            return ce_listwise_loss((logits[:, 1] - logits[:, 0]).view(group_caps.shape))
        labels = np.zeros(group_caps.shape, dtype=np.int64)
        labels[:, 0] = 1
        return ce_pair_loss(logits, torch.from_numpy(labels.reshape(-1)).to(self.device))

    def _by_length_chunks(self, texts: list[str], make_batch, forward) -> torch.Tensor:
        """``forward`` over length-sorted chunks of the batch (cfg.length_chunk_rows), rows back in input order."""
        chunks = length_chunks(self.collate_text.token_lengths(texts), self.cfg.length_chunk_rows)
        if len(chunks) == 1:
            return forward(self._to_device(make_batch(np.arange(len(texts)))))
        out = torch.cat([forward(self._to_device(make_batch(idx))) for idx in chunks])
        inverse = np.empty(len(texts), dtype=np.int64)
        inverse[np.concatenate(chunks)] = np.arange(len(texts))
        return out[torch.from_numpy(inverse).to(self.device)]

    def _optimizer_step(self, loss: Optional[torch.Tensor], lr: float, optimizer: torch.optim.Optimizer) -> dict:
        """One update from ``loss``'s gradient (None: the gradient is already accumulated); returns the gradient's
        norms before clipping, of the whole model and of the transformer alone (``bert.*``, what the objectives
        share): how hard each objective pulls on the shared weights."""
        if loss is not None:
            self.model.zero_grad(set_to_none=True)
            loss.backward()
        trunk = [p.grad for p in self._trunk if p.grad is not None]
        trunk_norm = float(torch.nn.utils.get_total_norm(trunk)) if trunk else 0.0
        norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip))
        for g in optimizer.param_groups:
            g["lr"] = lr * g.get("lr_mult", 1.0)
        optimizer.step()
        return {"grad_norm": round(norm, 5), "grad_norm_trunk": round(trunk_norm, 5)}

    def _update_ema(self, step: int) -> None:
        """The average after ``step``: its decay ramps up over the first steps ((1 + s) / (10 + s)), so the start's
        random new layers do not linger in it."""
        decay = min(self.cfg.ema_decay, (1.0 + step) / (10.0 + step))
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                if n in self.ema:
                    self.ema[n].mul_(decay).add_(p.detach().float(), alpha=1.0 - decay)

    @contextlib.contextmanager
    def _averaged(self):
        """The model holds the averaged weights inside the block (none without ema_decay), its own after."""
        if self.ema is None:
            yield
            return
        params = dict(self.model.named_parameters())
        raw = {n: params[n].detach().clone() for n in self.ema}
        with torch.no_grad():
            for n, v in self.ema.items():
                params[n].copy_(v)
        try:
            yield
        finally:
            with torch.no_grad():
                for n, v in raw.items():
                    params[n].copy_(v)

    def train_step(self, step: int) -> list[dict]:
        torch.manual_seed(self.cfg.seed * 1_000_003 + step)  # dropout of this step, independent of history
        caps = self._batch_indices(step)
        lr = self._lr_at(step)
        records = []
        for objective in self._objectives(step):
            t0 = time.perf_counter()
            if objective == "be":
                loss = self._be_loss(caps)
                norms = self._optimizer_step(loss, lr, self.optimizer)
            else:
                loss = self._ce_step_loss(caps, step)  # its backward has run
                norms = self._optimizer_step(None, lr, self.ce_optimizer)
            records.append({"step": step + 1, "objective": objective, "loss": float(loss.detach()), "lr": lr,
                            **norms, "seconds": round(time.perf_counter() - t0, 4)})
        if self.ema is not None:
            self._update_ema(step)
        return records

    # ------------------------------------------------------------------------------ the loop
    def train(self, resume: bool = False, stop_at: Optional[int] = None) -> dict:
        """Trains to ``cfg.steps`` (or pauses after step ``stop_at``, checkpointing ``last/``, as an interrupted
        job would); ``resume`` continues from ``output/last/``."""
        from tqdm.auto import tqdm

        os.makedirs(self.out, exist_ok=True)
        if resume:
            self.load_state(os.path.join(self.out, "last"))
        elif self.step == 0 and self.cfg.image_init == "lstsq":
            r2 = lstsq_image_embedding(self.model, self.data)
            trim_heap()
            with open(os.path.join(self.out, LOG_FILE), "a") as f:
                f.write(json.dumps({"step": 0, "image_init": "lstsq", "r2": round(r2, 4)}) + "\n")
        previous = torch.are_deterministic_algorithms_enabled()
        if self.device.type == "cpu":
            torch.use_deterministic_algorithms(True, warn_only=True)
        self.model.train()
        log = open(os.path.join(self.out, LOG_FILE), "a")
        try:
            bar = tqdm(total=self.cfg.steps, initial=self.step, desc=f"train {self.cfg.objective}",
                       disable=not self.cfg.progress, unit="step")
            end = self.cfg.steps if stop_at is None else min(stop_at, self.cfg.steps)
            for step, self._ready in self._read_ahead(self.step, end):
                assert step == self.step
                records = self.train_step(self.step)
                trim_heap()
                self._ready = {}
                self.step += 1
                for r in self._pending_logs + records:
                    log.write(json.dumps(r) + "\n")
                self._pending_logs = []
                bar.update(1)
                bar.set_postfix({r["objective"]: f"{r['loss']:.3f}" for r in records})
                last = self.step == self.cfg.steps
                if self.dev is not None and (last or (self.cfg.eval_every and self.step % self.cfg.eval_every == 0)):
                    self._evaluate_and_keep_best(log)
                scheduled = bool(self.cfg.checkpoint_every) and self.step % self.cfg.checkpoint_every == 0
                if self.cfg.keep_checkpoints and (scheduled or last):  # before last/: a resume never skips it
                    with self._averaged():
                        self._save_model(checkpoint_path(self.out, self.step))
                if last or self.step == end or scheduled:
                    self.save_state(os.path.join(self.out, "last"))
                log.flush()
            bar.close()
        finally:
            log.close()
            self.model.eval()
            torch.use_deterministic_algorithms(previous)
        best_dir = os.path.join(self.out, "best") if self.best_eval is not None else os.path.join(self.out, "last")
        return {"steps": self.step, "best_dir": best_dir, "best_metric": self.best_metric, "best_eval": self.best_eval}

    def _selection_metric(self, ev: dict) -> float:
        # A CE-only model's BE head is untrained: select it by its own head's dev pair accuracies. Against random
        # images the CE saturates early (docs/TRAINING.md); against the nearest image - what a reranker must
        # separate - it keeps improving, so that one counts too.
        if self.cfg.objective == "ce":
            return 0.5 * (ev.get("ce_pair_acc", 0.0) + ev.get("ce_hard_pair_acc", 0.0))
        return ev["mR"]

    def _evaluate_and_keep_best(self, log) -> None:
        t0 = time.perf_counter()
        with self._averaged():  # what is evaluated is what best/ gets
            ev = evaluate(self.model, self.dev, str(self.device), self.cfg.eval_batch_size,
                          "bf16" if (self.cfg.amp and self.device.type == "cuda") else None, seed=self.cfg.seed,
                          progress=self.cfg.progress, desc=f"dev eval at step {self.step}")
            self.model.train()
            ev["seconds"] = round(time.perf_counter() - t0, 3)
            log.write(json.dumps({"step": self.step, "eval": ev}) + "\n")
            trim_heap()
            metric = self._selection_metric(ev)
            if metric > self.best_metric:
                self.best_metric, self.best_eval = metric, {"step": self.step, **ev}
                self._save_model(os.path.join(self.out, "best"), extra_files={"eval.json": self.best_eval})

    # ---------------------------------------------------------------------- checkpoint state
    def _save_model(self, directory: str, extra_files: Optional[dict] = None, state: bool = False) -> None:
        """Writes to a temp folder and renames, so a crash never leaves a half-written checkpoint."""
        tmp = directory + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        prov = self.model.cfg.provenance
        prov["training"] = {**asdict(self.cfg), "step": self.step}
        if "heads_trained" in prov:  # a converted checkpoint that lacked a head has it once trained here
            trained = ("be", "ce") if self.cfg.objective == "joint" else (self.cfg.objective,)
            prov["heads_trained"] = sorted(set(prov["heads_trained"]) | set(trained))
        self.model.save(tmp)
        for name, obj in (extra_files or {}).items():
            with open(os.path.join(tmp, name), "w") as f:
                json.dump(obj, f, indent=2)
        if state:
            self._write_trainer_state(tmp)
        if os.path.isdir(directory):
            old = directory + ".old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(directory, old)
            os.replace(tmp, directory)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, directory)

    def save_state(self, directory: str) -> None:
        self._save_model(directory, state=True)

    def _optimizers(self) -> dict[str, torch.optim.Optimizer]:
        """The AdamW states a checkpoint keeps, by key prefix: ``state`` (the BE's, or the only one) and, with
        ``joint_optimizer="separate"``, ``ce_state``."""
        return {"state": self.optimizer, **({"ce_state": self.ce_optimizer}
                                            if self.ce_optimizer is not self.optimizer else {})}

    def _write_trainer_state(self, directory: str) -> None:
        tensors, groups = {}, {}
        for prefix, optimizer in self._optimizers().items():
            sd = optimizer.state_dict()
            tensors.update({f"{prefix}.{i}.{k}": v.detach().cpu().contiguous() for i, st in sd["state"].items()
                            for k, v in st.items()})
            groups[prefix] = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()}
                              for g in sd["param_groups"]]
        if self.mined is not None:  # a resumed run keeps the negatives mined by the model of their window start
            tensors.update({f"mined.{k}": torch.from_numpy(v) for k, v in self.mined.arrays().items()})
        if self.ema is not None:
            tensors.update({f"ema.{n}": v.detach().cpu().contiguous() for n, v in self.ema.items()})
        save_file(tensors, os.path.join(directory, STATE_TENSORS))
        with open(os.path.join(directory, STATE_JSON), "w") as f:
            json.dump({"step": self.step, "best_metric": self.best_metric, "best_eval": self.best_eval,
                       "param_groups": groups.pop("state"), **{f"{p}_param_groups": g for p, g in groups.items()},
                       "config": asdict(self.cfg), "mined_until": self.mined_until}, f, indent=2)

    def load_state(self, directory: str) -> None:
        """Restores model weights, AdamW moments, step and best metric from a ``last/`` checkpoint."""
        if not os.path.isfile(os.path.join(directory, STATE_JSON)):
            raise FileNotFoundError(f"cannot resume: {directory} has no {STATE_JSON}")
        with open(os.path.join(directory, STATE_JSON)) as f:
            meta = json.load(f)
        # the schedule's settings; a checkpoint from before an option existed had its default
        before = {"joint_optimizer": "shared", "be_every": 1}
        for key in ("objective", "steps", "batch_size", "seed", "be_loss", "joint_optimizer", "be_every"):
            if meta["config"].get(key, before.get(key)) != getattr(self.cfg, key):
                raise ValueError(f"cannot resume: checkpoint has {key}={meta['config'].get(key)!r}, "
                                 f"this run {getattr(self.cfg, key)!r}")
        weights = load_file(os.path.join(directory, WEIGHTS_FILE))
        self.model.load_state_dict(weights, strict=True)
        tensors = load_file(os.path.join(directory, STATE_TENSORS), device=str(self.device))
        mined = {key.split(".", 1)[1]: tensors.pop(key).cpu().numpy()
                 for key in list(tensors) if key.startswith("mined.")}
        ema = {key.split(".", 1)[1]: tensors.pop(key) for key in list(tensors) if key.startswith("ema.")}
        if self.ema is not None:
            if set(ema) != set(self.ema):
                raise ValueError(f"cannot resume: {directory} holds no weight average of this run's parameters")
            self.ema = {n: v.to(self.device) for n, v in ema.items()}
        if mined:
            self.mined, self.mined_until = MinedNegatives(**mined), int(meta["mined_until"])
        for prefix, optimizer in self._optimizers().items():
            state: dict[int, dict] = {}
            for key, v in tensors.items():
                head, i, name = key.split(".", 2)
                if head == prefix:
                    state.setdefault(int(i), {})[name] = v.cpu() if name == "step" else v
            saved = meta["param_groups" if prefix == "state" else f"{prefix}_param_groups"]
            groups = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in saved]
            optimizer.load_state_dict({"state": state, "param_groups": groups})
        self.step, self.best_metric, self.best_eval = int(meta["step"]), float(meta["best_metric"]), meta["best_eval"]
