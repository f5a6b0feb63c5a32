"""The one Beam ModelHandler between RunInference and `VLRetrievalModel` (style of apache_beam.ml.inference).

A handler serves one task:

  ``embed_text``   element: caption text (str)                      -> (d,) float32 BE embedding
  ``embed_image``  element: (features (n,F), boxes (n,6)) numpy     -> (d,) float32 BE embedding
  ``score_pairs``  element: (text, features, boxes)                  -> () float32 CE match log-odds

``run_inference`` collates the batch it is given itself (per-batch padding through retrieval_core.model.collate),
so batches may mix lengths freely. Wrap it in ``KeyedModelHandler`` to keep ids attached::

    handler = KeyedModelHandler(VLModelHandler(model_dir, "embed_image", max_batch_size=64))
    keyed_embeddings = keyed_regions | RunInference(handler)   # (item_id, PredictionResult)

Dead letters: with ``dead_letter=True`` a batch whose inference raises does not fail the job: each of its
elements comes back as ``PredictionResult(example, FailedBatch(reason, traceback))`` in the one output (Beam's
``with_exception_handling`` would need a tagged second output, which DaskRunner does not separate); the caller
records them (pipelines.encode writes dead_letter.jsonl and exits non-zero).

Device: "cpu" or "cuda" (``retrieval_core.cli.DEVICES``, the one spelling). Asking for "cuda" where CUDA is
unusable raises in ``load_model`` instead of quietly running on CPU (Beam's PyTorch handlers fall back
silently). On Dataflow GPU workers (one SDK process per vCPU) pass ``model_copies=1`` (or ``large_model=True``)
so one copy per GPU is shared across processes.
"""
from __future__ import annotations

import logging
import traceback
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

import numpy as np
import torch
from apache_beam.metrics import Metrics
from apache_beam.ml.inference.base import ModelHandler, PredictionResult

from pipelines.common import BEAM_FILES
from retrieval_core.cli import check_device
from retrieval_core.data.schema import check_quantize
from retrieval_core.model.checkpoints import load_model_folder
from retrieval_core.model.collate import collate_images, collate_pairs

log = logging.getLogger(__name__)

TASK_EMBED_TEXT = "embed_text"
TASK_EMBED_IMAGE = "embed_image"
TASK_SCORE_PAIRS = "score_pairs"
TASKS = (TASK_EMBED_TEXT, TASK_EMBED_IMAGE, TASK_SCORE_PAIRS)
TASK_HEAD = {TASK_EMBED_TEXT: "be", TASK_EMBED_IMAGE: "be", TASK_SCORE_PAIRS: "ce"}  # the head a task runs

#: RunInference metrics (num_inferences, inference_batch_latency_micro_secs, inference_request_batch_size,
#: load_model_latency_milli_secs) land in ``<METRICS_NAMESPACE>_<task>``, one namespace per task.
METRICS_NAMESPACE = "RR_VLRetrieval"
#: Counters beside them: the token positions the encoder ran that carry tokens, and all it ran (padding included).
USEFUL_TOKENS, COMPUTED_TOKENS = "useful_tokens", "computed_tokens"


class DeviceUnavailableError(RuntimeError):
    """GPU was requested but torch sees no usable CUDA device."""


@dataclass(frozen=True)
class FailedBatch:
    """The inference of a dead-lettered element: why its batch failed (``dead_letter=True`` handlers)."""
    reason: str
    traceback: str = ""


def element_length(task: str, example: Any) -> int:
    """Padded-length proxy of one element: word count for text, region count for images, both for pairs.
    Used to sort elements so that a batch holds similar lengths (little padding)."""
    if task == TASK_EMBED_TEXT:
        return len(example.split())
    if task == TASK_EMBED_IMAGE:
        return int(len(example[0]))
    text, feats, _ = example
    return len(text.split()) + int(len(feats))


class VLModelHandler(ModelHandler[Any, np.ndarray, Any]):
    """ModelHandler for one task of a model folder (see module docstring): any folder that
    ``retrieval_core.model.checkpoints.load_model_folder`` loads and that has the task's head."""

    def __init__(self, model_dir: str, task: str, *, device: str = "cpu", max_batch_size: int = 64,
                 min_batch_size: int = 1, model_copies: Optional[int] = None, large_model: bool = False,
                 num_threads: Optional[int] = None, dead_letter: bool = False, quantize: Optional[str] = None):
        if task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {task!r}")
        device = check_device(device)
        if not 1 <= min_batch_size <= max_batch_size:
            raise ValueError(f"need 1 <= min_batch_size <= max_batch_size, got {min_batch_size}, {max_batch_size}")
        # max_batch_size is always set: BatchElements' own default may grow a batch to 10,000 elements.
        super().__init__(min_batch_size=min_batch_size, max_batch_size=max_batch_size,
                         large_model=large_model, model_copies=model_copies)
        self.model_dir = model_dir
        self.task = task
        self.device = device
        self.num_threads = num_threads
        self.dead_letter = dead_letter
        if quantize not in (None, "none"):  # refused at plan time, not in a worker
            check_quantize(quantize, device)
        self.quantize = quantize

    def __repr__(self) -> str:
        return f"VLModelHandler({self.model_dir!r}, {self.task!r}, device={self.device!r})"

    # ------------------------------------------------------------------------------------ model
    def load_model(self):
        if self.device == "cuda" and not torch.cuda.is_available():
            raise DeviceUnavailableError("device cuda was requested but torch.cuda.is_available() is False "
                                         f"(torch {torch.__version__}); use --device cpu or a CUDA worker")
        if self.num_threads:
            torch.set_num_threads(int(self.num_threads))
        # any model folder (ours, MMT-Retrieval, OSCAR, the training-free baseline), refused if it lacks the head;
        # a gs:// folder is copied to this machine's model cache once and loaded from there
        return load_model_folder(self.model_dir, need=(TASK_HEAD[self.task],),
                                 device=self.device, quantize=self.quantize,
                                 files=BEAM_FILES)

    def run_inference(self, batch: Sequence[Any], model, inference_args: Optional[dict] = None
                      ) -> Iterable[PredictionResult]:
        batch = list(batch)
        if not batch:
            return []
        if not self.dead_letter:
            return self._infer(batch, model)
        try:
            return self._infer(batch, model)
        except Exception as exc:  # noqa: BLE001 -- recorded per element, never dropped (module docstring)
            failed = FailedBatch(f"{type(exc).__name__}: {exc}", "".join(traceback.format_exc().splitlines(True)[-3:]))
            log.warning("%s: a batch of %d failed and is dead-lettered: %s", self, len(batch), failed.reason)
            return [PredictionResult(example, failed) for example in batch]

    def _infer(self, batch: list, model) -> list[PredictionResult]:
        if not hasattr(model, "cfg"):  # retrieval_core.model.baseline.MappedBaseline: numpy in, numpy out
            return [PredictionResult(example, out) for example, out in zip(batch, self._baseline(batch, model))]
        tensors = self.collate(batch, model)
        dev = model.device
        counts = model.token_counts[TASK_HEAD[self.task]]
        before = (counts.useful, counts.computed)
        with torch.inference_mode():
            tensors = {k: v.to(dev, non_blocking=True) for k, v in tensors.items()}
            out = getattr(model, self.task)(tensors).float().cpu().numpy()
        # the padding of the batches as formed: useful / computed token positions (encode reports the ratio)
        Metrics.counter(self.get_metrics_namespace(), USEFUL_TOKENS).inc(counts.useful - before[0])
        Metrics.counter(self.get_metrics_namespace(), COMPUTED_TOKENS).inc(counts.computed - before[1])
        return [PredictionResult(example, out[i]) for i, example in enumerate(batch)]

    def _baseline(self, batch: list, model) -> np.ndarray:
        if self.task == TASK_EMBED_TEXT:
            return model.encode_text(batch, batch_size=len(batch), device=self.device)
        return model.encode_image([_regions(f, b) for f, b in batch])

    def collate(self, batch: Sequence[Any], model) -> dict:
        """The batch as model inputs, padded to its own longest text / region count."""
        max_regions = model.cfg.max_regions
        if self.task == TASK_EMBED_TEXT:
            return model.text_collator()(batch)
        if self.task == TASK_EMBED_IMAGE:
            return collate_images([_regions(f, b) for f, b in batch], max_regions)
        texts = [t for t, _, _ in batch]
        return collate_pairs(model.text_collator(), texts, [_regions(f, b) for _, f, b in batch], max_regions)

    # ------------------------------------------------------------------------- Beam plumbing
    def validate_inference_args(self, inference_args: Optional[dict]) -> None:
        if inference_args:
            raise ValueError(f"VLModelHandler takes no inference_args, got {sorted(inference_args)}")

    def get_metrics_namespace(self) -> str:
        return f"{METRICS_NAMESPACE}_{self.task}"

    def get_num_bytes(self, batch: Sequence[Any]) -> int:
        # The default pickles the whole batch just to measure it; arrays know their size.
        total = 0
        for ex in batch:
            parts = ex if isinstance(ex, tuple) else (ex,)
            total += sum(p.nbytes if isinstance(p, np.ndarray) else len(p) for p in parts)
        return total


def _regions(features, boxes) -> tuple[np.ndarray, np.ndarray]:
    return (np.asarray(features, dtype=np.float32), np.asarray(boxes, dtype=np.float32))
