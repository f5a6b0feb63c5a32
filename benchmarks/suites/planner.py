"""How a suite's jobs are planned: its typed config (:class:`SuiteConfig`, :class:`Models`), the jobs and rows it
collects (:class:`Plan`, :class:`Row`), and the :class:`Planner` every suite goes through, so that a shared step
(stage, encode, index, a dev run) is planned once. What each suite contains: :mod:`benchmarks.suites.suites`."""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from typing import Literal, Optional

import click

from benchmarks import queries as sel
from benchmarks.suites.jobs import Job
from pipelines.build_index.plan import IndexPlan
from pipelines.encode.plan import EncodePlan
from pipelines.rerank.plan import RerankPlan
from pipelines.stage.plan import StagePlan
from retrieval_core.cli import (
    CheckedPlan,
    batch_size_option,
    derived,
    device_option,
    option,
    quantize_option,
    threads_option,
)
from retrieval_core.data import schema
from retrieval_core.data.manifest import load_manifest
from retrieval_core.data.schema import DIRECTION_I2T, DIRECTION_T2I
from retrieval_core.precision import QUANTIZE_AUTO, check_quantize, resolve_quantize

DIRECTIONS = (DIRECTION_T2I, DIRECTION_I2T)
SUITES = ("standard", "distractor_20k", "scale_100k", "scale_1m", "k_ablation", "combination", "baseline", "latency",
          "memory", "multilingual")
#: --quick: every collection shrunk to this many images (staged for real, through the same stage CLI).
QUICK_IMAGES = {"synthetic_coco5k": 100, "synthetic_f30k1k": 40, "synthetic_cc14k": 60, "synthetic_100k": 300,
                "synthetic_1m": 300, "synthetic_multi30k": 80}
# The AUTO rows (pipelines.rerank --mode auto's choice, runs.choose_fusion) choose on this split's queries:
# the demo collection's dev split, held out from the demo models' training and from every suite's test data.
TUNE_MANIFEST, TUNE_SPLIT = "demo", "dev"
# Pools larger than that dev split add distractors from here, so the fusion is chosen at the evaluated pool's size.
DEV_POOL_MANIFEST, DEV_DISTRACTORS = "synthetic_dev_pool", "synthetic_dev_distractors"
#: A compact staging (scale_1m's) keeps its region features in this dtype, and only the regions the models read.
COMPACT_FEATURE_DTYPE = "float16"


@dataclass(frozen=True)
class Models:
    """Model folders of the compared systems: SEP = be (BE objective) + ce (CE objective); JOIN = join."""
    join: Optional[str] = None
    be: Optional[str] = None
    ce: Optional[str] = None
    named: tuple[tuple[str, str], ...] = ()  # more JOIN models, (family name, folder): the multilingual suite's

    def families(self) -> list[tuple[str, str, str]]:
        """(family, BE model, CE model) of every family given."""
        out = []
        if self.be and self.ce:
            out.append(("SEP", self.be, self.ce))
        if self.join:
            out.append(("JOIN", self.join, self.join))
        out += [(name, folder, folder) for name, folder in self.named]
        if not out:
            raise ValueError("no models: give --model (JOIN) and/or --be-model with --ce-model (SEP)")
        return out

    @property
    def first(self) -> Optional[str]:
        """A model folder of the set (the JOIN model where there is one): what unit costs and widths are read from."""
        return self.join or next((folder for _, folder in self.named), None) or self.be


#: Default query caps per direction: on CPU the CE is the bottleneck and the full protocols take long
#: (docs/BENCHMARKS.md, "Sampling and cost on 2 CPU cores"; the costs: docs/log/SCALE-1M-2026-11-28.md). Pools are
#: never cut; 0 = every query.
DEFAULT_MAX_QUERIES = {"standard": 500, "distractor_20k": 500, "k_ablation": 500, "combination": 500,
                       "baseline": 0, "scale_100k": 0, "scale_1m": 0, "latency": 0,
                       "memory": 0, "multilingual": 500}
ANN_KINDS = ("IVF-Flat", "IVF-SQ8", "HNSW32")


@dataclass(frozen=True, kw_only=True)  # kw_only: the required --suite may come first, the resolved fields last
class SuiteConfig(CheckedPlan):
    """A suite run, typed: every option of ``python -m benchmarks.run`` is a field (the CLI is built from them),
    checked when built; ``models`` and ``feature_dim`` are resolved from the options when the suite runs."""
    suite: str = option(type=click.Choice(SUITES), help="Which benchmark suite to run.")
    manifest: Optional[str] = option(None, help="Run the suite on this manifest instead of its default ones.")
    join_dir: Optional[str] = option(None, name="--model", help="JOIN model folder [the recipe's JOIN model].")
    be_dir: Optional[str] = option(None, name="--be-model", help="SEP bi-encoder model folder [the recipe's SEP BE].")
    ce_dir: Optional[str] = option(None, name="--ce-model",
                                   help="SEP cross-encoder model folder [the recipe's SEP CE].")
    recipe: str = option("bench", type=click.Choice(["bench", "demo"]),
                         help="Which cached recipe trains the models not given (retrieval_core.training.recipes: the "
                              "benchmark recipe, or the demo's).")
    model_seeds: tuple[int, ...] = option((0,), name="--model-seed", sep=",", metavar="N[,N...]",
                                          help="Training seed(s) of the recipe's models (cached per seed). Several: "
                                               "the suite runs once per seed (<output>/seed<N>/) and "
                                               "<output>/<suite>_seeds.csv holds mean, std, min and max.")
    no_sep: bool = option(False, help="Skip the SEP rows (do not train the SEP demo models). latency, scale_100k and "
                                      "scale_1m run SEP only when --be-model and --ce-model are given.")
    output: str = option("results", help="Folder for <suite>.csv, <suite>_jobs.csv, plots.")
    workdir: Optional[str] = option(None, help="Staged data, pipeline outputs, cached models [$RR_WORKDIR or "
                                               "./runs].")
    plan_only: bool = option(False, name="--plan", help="Print the jobs (and their estimated cost from measured unit "
                                                        "costs) without running them.")
    quick: bool = option(False, help="Tiny sizes everywhere: a smoke run in a few minutes.")
    batch_size: int = batch_size_option(128)
    # cpu, not auto: the suites' sizes, budgets and --plan unit costs are the CPU's, and the latency and memory
    # suites measure it; a GPU run of a suite is asked for (--device cuda)
    device: str = device_option("cpu")
    threads: Optional[int] = threads_option()
    quantize: str = quantize_option("none", help="Serving precision of the encode and CE jobs (their --quantize, "
                                                 "auto resolved for --device): bf16 = matrix products in bfloat16 "
                                                 "(CUDA, or a CPU with native bf16); outputs go to folders of their "
                                                 "own.")
    ce_pair_budget: int = option(200_000, type=click.IntRange(min=0),
                                 help="Exhaustive CE rows only up to this many (query, item) pairs; otherwise skipped "
                                      "with a note.")
    max_queries: Optional[int] = option(None, type=click.IntRange(min=0),
                                        help="Seeded sample of at most this many queries per direction, pools "
                                             "unchanged (noted in every row); 0 = the full protocol. Default: per "
                                             "suite, sized for the 2-core CPU budgets (planner.DEFAULT_MAX_QUERIES).")
    index_factory: str = option("Flat", help="FAISS factory of every build_index job.")
    memory_sizes: tuple[int, ...] = option((), sep=",", metavar="N,N,...", show_default=False,
                                           help="memory: collection sizes in images [20000,100000,200000; --quick: "
                                                "200,400].")
    ann: tuple[str, ...] = option(ANN_KINDS, sep=",",
                                  help="latency: ANN rows, comma-separated: IVF-Flat, IVF-SQ8, IVF-PQ, HNSW<M>.")
    hnsw_max_n: int = option(100_000, type=click.IntRange(min=0),
                             help="latency: build HNSW rows only up to this many items (1M takes many minutes on 2 "
                                  "cores).")
    eval_budget: float = option(600.0, type=click.FloatRange(min=0),
                                help="latency: seconds of Table 4 pipeline runs; larger settings are extrapolated.")
    fresh_interpreters: bool = option(False, help="Start every job as a new `python -m` process instead of forking "
                                                  "it from a server that imported Beam, torch and the pipelines once "
                                                  "(~6 s less per job on 2 cores; a forked job's peak RSS includes "
                                                  "those modules). The memory and latency suites always start fresh.")
    models: Models = derived(default_factory=Models)
    feature_dim: Optional[int] = derived(None)
    model_regions: int = derived(schema.DEFAULT_MAX_REGIONS)  # the most regions per image any of the models reads
    seed: int = derived(0)  # the latency suite's data seed

    def __post_init__(self) -> None:
        if self.suite not in SUITES:
            raise ValueError(f"unknown suite {self.suite!r} (known: {', '.join(SUITES)})")
        super().__post_init__()
        need = "distinct non-negative seeds"
        object.__setattr__(self, "model_seeds", _ints("--model-seed", self.model_seeds, "seeds", need, minimum=0))
        if len(set(self.model_seeds)) != len(self.model_seeds):
            raise ValueError(f"--model-seed needs {need}, got {','.join(map(str, self.model_seeds))!r}")
        if len(self.model_seeds) > 1 and self.join_dir and (self.no_sep or (self.be_dir and self.ce_dir)):
            raise ValueError("--model-seed with several seeds trains the recipe's models: give no model folders")
        object.__setattr__(self, "memory_sizes", _ints("--memory-sizes", self.memory_sizes, "image counts",
                                                       "positive image counts", minimum=1, allow_empty=True))
        if self.memory_sizes and self.suite != "memory":
            raise ValueError("--memory-sizes is for --suite memory")
        if self.max_queries is None:
            object.__setattr__(self, "max_queries", DEFAULT_MAX_QUERIES[self.suite])
        if self.batch_size < 1 or (self.feature_dim is not None and self.feature_dim < 1):
            raise ValueError("batch_size and feature_dim must be >= 1")
        object.__setattr__(self, "quantize", resolve_quantize(self.quantize, self.device))
        check_quantize(self.quantize, self.device)

    @property
    def root(self) -> str:
        return os.path.join(self.workdir or "", "bench")


def _ints(flag: str, values, what: str, need: str, minimum: int, allow_empty: bool = False) -> tuple[int, ...]:
    """A comma-separated option's values as ints >= ``minimum`` (one-line ValueError naming the flag)."""
    text = ",".join(map(str, values))
    try:
        ints = tuple(int(v) for v in values)
    except (TypeError, ValueError):
        raise ValueError(f"{flag} takes comma-separated {what}, got {text!r}") from None
    if (not ints and not allow_empty) or any(v < minimum for v in ints):
        raise ValueError(f"{flag} needs {need}, got {text!r}")
    return ints


@dataclass(frozen=True)
class Row:
    """One CSV row group (one row per direction): ``runs`` (one rerank run, or one per fold: the mean) read
    by evaluate_run with ``eval_k`` / ``eval_mode`` / ``eval_lam``; ``timing`` = ((CSV column, job name),
    ...) whose wall times the row reports; ``emb_runs``: the runs (one per fold) whose EMB ranking the row's
    difference is paired with (empty: no difference); ``skip`` = why the row was not run (then nothing else
    matters); ``extrapolated`` = (CO job, search-only job) of an exhaustive CE row that was not run: its cost
    per query from theirs (benchmarks.suites.rows), no recall."""
    suite: str
    collection: str
    model: str
    mode: str
    k: Optional[int | Literal["all"]] = None  # the rerank depth the row reports; "all": exhaustive CE; None: EMB
    lam: Optional[float] = None  # the fusion weight of an ADD / NORM_ADD row
    runs: tuple[str, ...] = ()
    staged: str = ""
    eval_collection: Optional[str] = None
    split: Optional[str] = "test"
    eval_k: Optional[int] = None
    eval_mode: Optional[str] = None
    eval_lam: Optional[float] = None
    tune_on: str = ""  # eval_mode "auto": the dev run (and its staged folder) the fusion is chosen on
    tune_staged: str = ""
    timing: tuple[tuple[str, str], ...] = ()
    per_fold: bool = False  # index_s / rerank_s are per fold (means); encode_s is shared by the folds
    emb_runs: tuple[str, ...] = ()  # a reranked row's paired baseline: the EMB ranking of these runs (one per fold)
    lang: Optional[str] = None  # evaluated on the captions of this language only (multilingual)
    pool_images: int = 0
    pool_captions: int = 0  # an extrapolated row's i2t pool
    notes: tuple[str, ...] = ()
    skip: str = ""
    extrapolated: tuple[str, ...] = ()

    def __post_init__(self):
        if not (self.k is None or self.k == "all" or (isinstance(self.k, int) and self.k >= 1)):
            raise ValueError(f"Row.k must be a depth >= 1, 'all' or None, got {self.k!r}")


@dataclass
class Plan:
    jobs: list[Job] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)

    def add(self, job: Job) -> Job:
        for j in self.jobs:
            if j.name == job.name:
                if j != job:
                    raise ValueError(f"two different jobs are both named {job.name!r}")
                return j
        self.jobs.append(job)
        return job


# ------------------------------------------------------------------------------------------ helpers
def _slug(*parts) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", "-".join(str(p) for p in parts if p not in (None, "")))


def model_key(path: str) -> str:
    """A short, stable folder name for a model: its folder name(s) + a hash of its absolute path."""
    path = os.path.abspath(path)
    name = os.path.basename(path)
    if name in ("best", "last"):
        name = os.path.basename(os.path.dirname(path)) + "_" + name
    return _slug(name) + "-" + hashlib.sha256(path.encode()).hexdigest()[:8]


def model_feature_dim(path: str) -> Optional[int]:
    """The region feature width a model folder expects (VLRetrievalModel or MappedBaseline), None if absent."""
    for name in ("rr_model.json", "rr_baseline.json"):
        try:
            with open(os.path.join(path, name)) as f:
                return int(json.load(f)["feature_dim"])
        except (OSError, KeyError, ValueError):
            continue
    return None


def model_max_regions(path: str) -> Optional[int]:
    """The regions per image a model folder reads (any kind inspect_model_folder knows), None if not there yet."""
    from retrieval_core.model.checkpoints import CheckpointError, inspect_model_folder

    if not path or not os.path.isdir(path):
        return None
    try:
        return int(inspect_model_folder(path).max_regions)
    except CheckpointError:
        return None


def _model_inputs(path: str) -> tuple[str, ...]:
    from retrieval_core.model.baseline import BASELINE_JSON
    from retrieval_core.model.network import MODEL_JSON, WEIGHTS_FILE

    return tuple(os.path.join(path, n) for n in (MODEL_JSON, WEIGHTS_FILE, BASELINE_JSON))


def _run_options(cfg: SuiteConfig) -> dict:
    """What every job that runs a model takes from the suite config."""
    return dict(device=cfg.device, batch_size=cfg.batch_size, threads=cfg.threads)


@dataclass(frozen=True)
class Staged:
    """A staged manifest as planned: its folder, stage job and per-collection sizes (from the manifest)."""
    name: str
    path: str
    job: Job
    manifest: object
    images: dict  # collection -> images
    captions: dict  # collection -> captions

    @property
    def summary(self) -> str:
        return os.path.join(self.path, "summary.json")


def _collection_sizes(m) -> tuple[dict, dict]:
    """Planned (images, captions) per collection: a synthetic generator's counts, else the manifest's expected
    counts of the benchmark split (per-split checks) or in all (0 where unknown)."""
    split = m.benchmark.get("split", "test")

    def expected(value) -> int:
        return int(value.get(split, 0)) if isinstance(value, dict) else int(value or 0)

    images, captions = {}, {}
    for name, c in m.collections.items():
        if c.images.format == "synthetic" and c.captions.format == "synthetic":
            spec = m.synthetic_spec(name)  # its counts: captions_per_image's default and every language
            images[name], captions[name] = spec.num_images, spec.num_captions
            continue
        n = c.images.options.get("num_images") or expected(c.expected_images)
        images[name] = int(n)
        captions[name] = expected(c.expected_captions)
    return images, captions


def split_share(collection, split: str) -> float:
    """The share of a collection's images in ``split`` (its ``splits`` fractions; 1.0 when it is not split)."""
    fractions = collection.images.options.get("splits")
    return float(fractions.get(split, 0.0)) / sum(fractions.values()) if fractions else 1.0


def split_sizes(st: Staged, split: str) -> tuple[int, int]:
    """(images, captions) of ``split`` over a staged dataset's collections: what an encode of that split costs."""
    shares = {name: split_share(c, split) for name, c in st.manifest.collections.items()}
    return (round(sum(st.images[n] * f for n, f in shares.items())),
            round(sum(st.captions[n] * f for n, f in shares.items())))


def stage_job(cfg: SuiteConfig, manifest: str, images: Optional[int] = None,
              sizes: tuple[tuple[str, int, int], ...] = (), compact: bool = False) -> Staged:
    """The stage job of ``manifest`` at the models' feature_dim (synthetic features only: real features are
    read from files, so another width is refused naming both) and, with --quick, shrunk (QUICK_IMAGES);
    ``images`` cuts every collection to that many images instead; ``sizes``: (collection, images, captions per
    image) of single collections, applied last; ``compact``: only the regions the models read
    (``cfg.model_regions``; the stager keeps them most confident first, so the cut is lossless for them) in
    COMPACT_FEATURE_DTYPE, a staged folder of its own, its spill lzf-compressed (the spill and the shards
    coexist at the end of the job: the disk peak of a 1M staging)."""
    m = load_manifest(manifest)
    sets, suffix = [], ""
    if cfg.feature_dim != m.feature_dim:
        real = sorted(name for name, c in m.collections.items() if c.images.format != "synthetic")
        if real:
            raise ValueError(
                f"manifest {m.name!r} has {m.feature_dim}-d region features (collection(s) {', '.join(real)} "
                f"read them from files), but the model expects {cfg.feature_dim}-d features; pass models trained "
                f"on {m.feature_dim}-d features (--model, --be-model, --ce-model)")
        sets.append(f"feature_dim={cfg.feature_dim}")
        suffix += f"-f{cfg.feature_dim}"
    if images or cfg.quick:
        for name in m.collections:
            sets += [f"{name}.images.num_images={images or QUICK_IMAGES.get(name, 50)}",
                     f"{name}.expected_images=null", f"{name}.expected_captions=null"]
        suffix += f"-n{images}" if images else "-quick"
    for name, n, per_image in sizes:
        sets += [f"{name}.images.num_images={n}", f"{name}.captions.captions_per_image={per_image}",
                 f"{name}.expected_images=null", f"{name}.expected_captions=null"]
        suffix += f"-{name.split('_')[-1]}{n}x{per_image}"
    m = load_manifest(manifest, overrides=sets)
    images, captions = _collection_sizes(m)
    extra = {}
    if compact:
        extra = dict(feature_dtype=COMPACT_FEATURE_DTYPE, max_regions=cfg.model_regions, spill_compression="lzf")
        suffix += f"-r{cfg.model_regions}-{COMPACT_FEATURE_DTYPE}"
    out = os.path.join(cfg.root, "staged", m.name + suffix)
    job = Job.of(f"stage {m.name}{suffix}", StagePlan(output=out, manifest=manifest, overrides=tuple(sets), **extra),
                 "summary.json", (("stage_records", sum(images.values()) + sum(captions.values())),))
    return Staged(m.name + suffix, out, job, m, images, captions)


class Planner:
    """Builds one suite's Plan; every job goes through here, so a shared step is planned once. ``compact``: every
    collection staged compact (stage_job); ``dev_pool_max``: the AUTO rows' dev pools at most this many images
    (0: as large as the evaluated pool)."""
    def __init__(self, cfg: SuiteConfig, compact: bool = False, dev_pool_max: int = 0):
        self.cfg = cfg
        self.plan = Plan()
        self.compact, self.dev_pool_max = compact, dev_pool_max
        self._staged: dict[str, Staged] = {}

    # -- jobs
    def stage(self, manifest: str, images: Optional[int] = None, sizes: tuple = ()) -> Staged:
        key = (manifest, images, sizes)
        if key not in self._staged:
            st = stage_job(self.cfg, manifest, images, sizes, compact=self.compact)
            self.plan.add(st.job)
            self._staged[key] = st
        return self._staged[key]

    def select(self, st: Staged, collection: str, *, max_queries: int = 0, fold: Optional[int] = None,
               folds: int = 0, fold_size: int = 0, scale: int = 0, split: str = "test",
               lang: Optional[str] = None) -> Job:
        seed = self.cfg.seed
        if fold is not None:
            what = f"fold{fold}of{folds}x{fold_size}-q{max_queries}"
        elif scale:
            what = f"scale{scale}"
        else:
            what = f"q{max_queries}" if max_queries else "all"
        what += f"-{lang}" if lang else ""
        out = os.path.join(self.cfg.root, "queries", st.name, _slug(collection, split, what, f"seed{seed}"))
        plan = sel.QueriesPlan(staged=st.path, collection=collection, output=out, split=split, max_queries=max_queries,
                               seed=seed, fold=fold, folds=folds if fold is not None else 0,
                               fold_size=fold_size if fold is not None else 0, scale=scale, lang=lang)
        where = collection if split == "test" else f"{collection}/{split}"
        return self.plan.add(Job.of(f"queries {st.name}/{where} {what}", plan, sel.SELECTION_FILE,
                                    inputs=(st.summary,)))

    def _job_quantize(self) -> str:
        """The jobs' --quantize: float32 on CPU is their default (auto), left unwritten; on CUDA written out,
        since there their default is bf16."""
        return QUANTIZE_AUTO if self.cfg.quantize == "none" and self.cfg.device == "cpu" else self.cfg.quantize

    def model_key(self, model: str) -> str:
        """A model's folder name in this plan's outputs: another --quantize encodes and scores elsewhere."""
        return model_key(model) + ("" if self.cfg.quantize == "none" else f"-{self.cfg.quantize}")

    def encode(self, st: Staged, model: str, split: str = "test") -> Job:
        out = os.path.join(self.cfg.root, "embeddings", self.model_key(model), st.name + ("" if split == "test" else
                                                                                     f"-{split}"))
        plan = EncodePlan(staged=st.path, model=model, output=out, split=split, quantize=self._job_quantize(),
                          **_run_options(self.cfg))
        n_img, n_cap = split_sizes(st, split)
        work = (("images_encoded", n_img), ("captions_encoded", n_cap))
        return self.plan.add(Job.of(f"encode {self.model_key(model)} {st.name}{'' if split == 'test' else '/' + split}",
                                    plan, "embeddings_manifest.json", work, inputs=(st.summary, *_model_inputs(model))))

    def index(self, st: Staged, model: str, enc: Job, modality: str = "image", ids: Optional[Job] = None,
              pool: str = "all") -> Job:
        out = os.path.join(self.cfg.root, "index", self.model_key(model), st.name, _slug(pool, modality))
        inputs = [os.path.join(enc.output, "embeddings_manifest.json")]
        ids_file = None
        if ids is not None:
            ids_file = os.path.join(ids.output, sel.IMAGE_IDS_FILE if modality == "image" else sel.CAPTION_IDS_FILE)
            inputs.append(ids_file)
        plan = IndexPlan(embeddings=enc.output, output=out, modality=modality, factory=self.cfg.index_factory,
                         ids=ids_file, threads=self.cfg.threads)
        return self.plan.add(Job.of(f"index {self.model_key(model)} {st.name}/{pool} {modality}", plan,
                                    "index_manifest.json", inputs=tuple(inputs)))

    def rerank(self, st: Staged, family: str, be_model: str, ce_model: str, enc: Job, queries: Job, *, mode: str,
               k: int, index: Optional[Job], text_index: Optional[Job] = None, pool: str = "all", pairs: int = 0,
               split: str = "test", exhaustive_limit: int = 0, collection: Optional[str] = None) -> Job:
        """``pairs``: CE pairs it will score (estimates); ``exhaustive_limit``: --max-exhaustive-pairs of a
        --mode ce run (queries x pool summed over directions; default ``pairs``); ``collection``: the queries'
        collection, recorded in the run (needed to read a run whose staged folder holds several)."""
        models = _slug(family, self.model_key(be_model), self.model_key(ce_model) if mode != "emb" else "")
        out = os.path.join(self.cfg.root, "runs", st.name, _slug(pool, os.path.basename(queries.output)), models,
                           f"{mode}-k{k}")
        queries_file = os.path.join(queries.output, sel.QUERIES_FILE)
        inputs = [st.summary, os.path.join(enc.output, "embeddings_manifest.json"), queries_file]
        inputs += [os.path.join(j.output, "index_manifest.json") for j in (index, text_index) if j is not None]
        extra = {}
        if mode != "emb":
            extra.update(ce_model=ce_model, quantize=self._job_quantize())
            inputs += _model_inputs(ce_model)
        if mode == "ce":
            extra["max_exhaustive_pairs"] = max(exhaustive_limit or pairs, 1)
        plan = RerankPlan(staged=st.path, embeddings=enc.output, output=out, mode=mode, k=k, split=split,
                          collection=collection, queries=queries_file, index=index.output if index else None,
                          text_index=text_index.output if text_index else None, **_run_options(self.cfg), **extra)
        # the query selection is in the name: distractor_20k ranks two query sets against one pool
        name = f"rerank {family} {mode} k={k} {st.name}/{pool} {os.path.basename(queries.output)}"
        return self.plan.add(Job.of(name, plan, "rankings_manifest.json",
                                    (("ce_pairs", pairs),) if mode != "emb" else (), inputs=tuple(inputs)))

    def dev_run(self, family: str, be_model: str, ce_model: str, k: int, pool_images: int, pool_captions: int,
                text_index: bool = False) -> tuple[Job, Staged]:
        """The CO run the AUTO rows choose their fusion on: queries from the dev split of TUNE_MANIFEST (held out
        from the demo models' training) against a dev pool as large as the evaluated one (DEV_POOL_MANIFEST:
        unseen distractors added, with about as many captions); one per family, k and pool size."""
        demo = stage_job(self.cfg, TUNE_MANIFEST)  # not planned: its sizes only
        coll = next(iter(demo.manifest.collections))
        n_dev = round(demo.images[coll] * split_share(demo.manifest.collections[coll], TUNE_SPLIT))
        if self.dev_pool_max and pool_images > self.dev_pool_max:
            pool_captions = round(pool_captions * self.dev_pool_max / pool_images)
            pool_images = self.dev_pool_max
        extra = pool_images - n_dev
        if extra > 0:
            per_image = max(1, round((pool_captions - demo.captions[coll] / demo.images[coll] * n_dev) / extra))
            st = self.stage(DEV_POOL_MANIFEST, sizes=((DEV_DISTRACTORS, extra, per_image),))
        else:
            st = self.stage(TUNE_MANIFEST)
        n = self.cfg.max_queries
        qjob = self.select(st, coll, max_queries=n, split=TUNE_SPLIT)
        enc = self.encode(st, be_model, split=TUNE_SPLIT)
        idx = self.index(st, be_model, enc, "image", pool=f"{TUNE_SPLIT}-all")
        txt = self.index(st, be_model, enc, "text", pool=f"{TUNE_SPLIT}-all") if text_index else None
        run = self.rerank(st, family, be_model, ce_model, enc, qjob, mode="co", k=k, index=idx, text_index=txt,
                          split=TUNE_SPLIT, pool=TUNE_SPLIT, pairs=2 * (n or n_dev) * k, collection=coll)
        return run, st

    # -- rows
    def row(self, **kw) -> Row:
        r = Row(suite=self.cfg.suite, **kw)
        self.plan.rows.append(r)
        return r
