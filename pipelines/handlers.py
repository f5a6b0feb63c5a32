"""The one Beam ModelHandler between RunInference and `VLRetrievalModel` (style of apache_beam.ml.inference).

A handler serves one task:

  ``embed_text``   element: caption text (str or its token ids)     -> (d,) float32 BE embedding
  ``embed_image``  element: (features (n,F), boxes (n,6)) numpy     -> (d,) float32 BE embedding
  ``score_pairs``  element: (text or token ids, features, boxes)     -> () float32 CE match log-odds

A caption's token ids (int32, ``retrieval_core.model.token_store``: each staged caption tokenised once per
tokenizer) skip the tokenizer here; ``tokenizer_fingerprint`` names the tokenizer that made them, and a model
whose tokenizer differs is refused at load.

``run_inference`` collates the batch it is given itself with the model's ``batch_maker`` (per-batch padding, the
same code as the library's batched loops, pinned memory and asynchronous copies on CUDA), so batches may mix
lengths freely. Wrap it in ``KeyedModelHandler`` to keep ids attached::

    handler = KeyedModelHandler(VLModelHandler(model_dir, "embed_image", max_batch_size=64))
    keyed_embeddings = keyed_regions | RunInference(handler)   # (item_id, PredictionResult)

Dead letters: with ``dead_letter=True`` a batch whose inference raises does not fail the job: each of its
elements comes back as ``PredictionResult(example, FailedBatch(reason, traceback))`` in the one output (Beam's
``with_exception_handling`` would need a tagged second output, which DaskRunner does not separate); the caller
records them (pipelines.encode writes dead_letter.jsonl and exits non-zero).

Device: "cpu", "cuda" or "cuda:N" (``retrieval_core.cli.check_device``, the one spelling). Asking for a GPU
where CUDA is unusable raises in ``load_model`` instead of quietly running on CPU (Beam's PyTorch handlers fall back
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

from pipelines.files import BEAM_FILES, write_atomic
from retrieval_core.cli import check_device, device_kind, memory_failure
from retrieval_core.data.store import StagedDataset
from retrieval_core.memory import HeapTrimmer
from retrieval_core.model.checkpoints import KIND_BASELINE, inspect_model_folder, load_model_folder
from retrieval_core.model.collate import to_device
from retrieval_core.model.token_store import TokenStore, ensure_token_store, tokenizer_fingerprint
from retrieval_core.precision import check_quantize

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
#: Batches between two ``trim_heap`` calls: batches of changing lengths fragment glibc's heap, which kept
#: free chunks resident through a long encode; docs/ARCHITECTURE.md (`pipelines.encode`) has the measured trade.
TRIM_EVERY = 16


class DeviceUnavailableError(RuntimeError):
    """GPU was requested but torch sees no usable CUDA device."""


@dataclass(frozen=True)
class FailedBatch:
    """The inference of a dead-lettered element: why its batch failed (``dead_letter=True`` handlers)."""
    reason: str
    traceback: str = ""


def prepare_token_ids(staged: StagedDataset, model_dir: str) -> Optional[str]:
    """Tokenises the staged captions once for the model's tokenizer (``retrieval_core.model.token_store``, on
    the launching host, before the graph runs; a gs:// staged folder gets its store there) and returns its
    fingerprint, which the readers and the handler are given; None where the model folder is the training-free
    baseline (its own text encoder): its handler tokenises each batch."""
    if inspect_model_folder(model_dir, files=BEAM_FILES).kind == KIND_BASELINE:
        return None
    model = load_model_folder(model_dir, files=BEAM_FILES)
    return ensure_token_store(staged, model.text_collator(), log=log.info, write=write_atomic).fingerprint


class CaptionTexts:
    """What a reader hands the handler for a staged caption shard's captions: their token ids from the store
    of ``fingerprint`` (None: their text)."""

    def __init__(self, fingerprint: Optional[str]):
        self.fingerprint = fingerprint
        self._store = None

    def __call__(self, ds: StagedDataset, rel: str, split: Optional[str] = None,
                 wanted: Optional[set] = None) -> tuple[list[int], list]:
        """(caption ids, texts or token ids) of the shard's captions (of ``split``; only ``wanted`` ids)."""
        columns = ("caption_id",) if self.fingerprint else ("caption_id", "text")
        table = ds.read_shard_columns(rel, columns, split)
        ids = [int(c) for c in table.column("caption_id").to_pylist()]
        keep = [i for i, c in enumerate(ids) if wanted is None or c in wanted]
        ids = [ids[i] for i in keep]
        if not self.fingerprint:
            texts = table.column("text").to_pylist()
            return ids, [texts[i] for i in keep]
        if self._store is None:
            self._store = TokenStore(ds, self.fingerprint)
        return ids, self._store.ids_of(rel, ids)


def element_length(task: str, example: Any) -> int:
    """Padded-length proxy of one element: word count for text (token count for token ids), region count for
    images, both for pairs. Used to sort elements so that a batch holds similar lengths (little padding)."""
    if task == TASK_EMBED_TEXT:
        return _text_length(example)
    if task == TASK_EMBED_IMAGE:
        return int(len(example[0]))
    text, feats, _ = example
    return _text_length(text) + int(len(feats))


def _text_length(text) -> int:
    return len(text.split()) if isinstance(text, str) else int(len(text))


class VLModelHandler(ModelHandler[Any, np.ndarray, Any]):
    """ModelHandler for one task of a model folder (see module docstring): any folder that
    ``retrieval_core.model.checkpoints.load_model_folder`` loads and that has the task's head."""

    def __init__(self, model_dir: str, task: str, *, device: str = "cpu", max_batch_size: int = 64,
                 min_batch_size: int = 1, model_copies: Optional[int] = None, large_model: bool = False,
                 num_threads: Optional[int] = None, dead_letter: bool = False, quantize: Optional[str] = None,
                 token_fingerprint: Optional[str] = None, collate_workers: Optional[int] = None):
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
        self.token_fingerprint = token_fingerprint
        if collate_workers is not None and collate_workers < 1:
            raise ValueError(f"collate_workers must be >= 1, got {collate_workers}")
        self.collate_workers = collate_workers
        self._trimmer = HeapTrimmer(TRIM_EVERY)
        self._maker = None  # (model, its BatchMaker): made on the worker, at the first batch

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_maker": None}  # a worker's model and buffers never travel

    def __repr__(self) -> str:
        return f"VLModelHandler({self.model_dir!r}, {self.task!r}, device={self.device!r})"

    # ------------------------------------------------------------------------------------ model
    def load_model(self):
        if device_kind(self.device) == "cuda" and not torch.cuda.is_available():
            raise DeviceUnavailableError(f"device {self.device} was requested but torch.cuda.is_available() is False "
                                         f"(torch {torch.__version__}); use --device cpu or a CUDA worker")
        if self.num_threads:
            torch.set_num_threads(int(self.num_threads))
        # any model folder (ours, MMT-Retrieval, OSCAR, the training-free baseline), refused if it lacks the head;
        # a gs:// folder is copied to this machine's model cache once and loaded from there
        model = load_model_folder(self.model_dir, need=(TASK_HEAD[self.task],),
                                  device=self.device, quantize=self.quantize,
                                  files=BEAM_FILES)
        if self.token_fingerprint is not None:
            have = tokenizer_fingerprint(model.text_collator()) if hasattr(model, "text_collator") else None
            if have != self.token_fingerprint:
                raise ValueError(f"{self}: the captions' token ids were made by tokenizer {self.token_fingerprint}, "
                                 f"this model's tokenizer is {have}: its ids would mean other words")
        return model

    def run_inference(self, batch: Sequence[Any], model, inference_args: Optional[dict] = None
                      ) -> Iterable[PredictionResult]:
        batch = list(batch)
        if not batch:
            return []
        self._trimmer.tick()
        if not self.dead_letter:
            return self._infer(batch, model)
        try:
            return self._infer(batch, model)
        except Exception as exc:  # noqa: BLE001 -- recorded per element, never dropped (module docstring)
            if memory_failure(exc) is not None:
                # not a bad record: dead-lettering it let an encode under a memory cap go on until a thread
                # could not start, and the job hung; failing names the need and the option (cli_errors)
                raise
            failed = FailedBatch(f"{type(exc).__name__}: {exc}", "".join(traceback.format_exc().splitlines(True)[-3:]))
            log.warning("%s: a batch of %d failed and is dead-lettered: %s", self, len(batch), failed.reason)
            return [PredictionResult(example, failed) for example in batch]

    def _infer(self, batch: list, model) -> list[PredictionResult]:
        if not hasattr(model, "cfg"):  # retrieval_core.model.baseline.MappedBaseline: numpy in, numpy out
            return [PredictionResult(example, out) for example, out in zip(batch, self._baseline(batch, model))]
        tensors = self.collate(batch, model)
        counts = model.token_counts[TASK_HEAD[self.task]]
        before = (counts.useful, counts.computed)
        with torch.inference_mode():
            out = getattr(model, self.task)(to_device(tensors, model.device)).float().cpu().numpy()
        # the padding of the batches as formed: useful / computed token positions (encode reports the ratio)
        Metrics.counter(self.get_metrics_namespace(), USEFUL_TOKENS).inc(counts.useful - before[0])
        Metrics.counter(self.get_metrics_namespace(), COMPUTED_TOKENS).inc(counts.computed - before[1])
        return [PredictionResult(example, out[i]) for i, example in enumerate(batch)]

    def _baseline(self, batch: list, model) -> np.ndarray:
        if self.task == TASK_EMBED_TEXT:
            return model.encode_text(batch, batch_size=len(batch), device=self.device)
        return model.encode_image([(np.asarray(f, dtype=np.float32), np.asarray(b, dtype=np.float32))
                                   for f, b in batch])

    def collate(self, batch: Sequence[Any], model) -> dict:
        """The batch as model inputs, padded to its own longest text / region count: regions copied by
        ``collate_workers`` threads (default: the process's torch threads, idle while the batch is made) into
        host memory reused from batch to batch (run_inference returns after its batch ran)."""
        if self._maker is None or self._maker[0] is not model:
            workers = self.collate_workers or torch.get_num_threads()
            self._maker = (model, model.batch_maker(workers=workers, ring=2))
        make = self._maker[1]
        if self.task == TASK_EMBED_TEXT:
            return make.text(batch)
        if self.task == TASK_EMBED_IMAGE:
            return make.images([_regions(f, b) for f, b in batch])
        return make.pairs([t for t, _, _ in batch], [_regions(f, b) for _, f, b in batch])

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
    """Arrays as staged (float16 or float32: collate widens them in its one copy), other inputs as float32."""
    return _floats(features), _floats(boxes)


def _floats(a) -> np.ndarray:
    a = np.asarray(a)
    return a if a.dtype in (np.float32, np.float16) else a.astype(np.float32)
