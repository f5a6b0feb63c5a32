"""Every pipeline's graph translates for Dataflow, offline; the pipeline CLIs print no Beam "apitools" warning.

``--runner=DataflowRunner --dry_run=True`` runs all of Dataflow's job construction except the submission
(``DataflowRunner.run_pipeline``): its transform overrides and side-input rewrite, the Runner API proto with
every DoFn pickled (``Pipeline.run`` also round-trips the graph through that proto), coders, and the Docker
environment of ``--sdk_container_image``; it then returns before credentials, staging uploads or API calls.
A graph Dataflow cannot take fails here, and so does a launcher that reads outputs after a dry run or
writes anything. Sockets are blocked during each dry run, which proves it stays offline.

Inputs: a tiny synthetic collection staged, encoded and indexed on DirectRunner by the CLIs themselves.
Outputs are local paths: gs:// ones would make the launchers ask GCS whether earlier outputs exist.
Needs apache-beam[gcp] (the "test" extra of setup.py).
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from pipelines.build_index import run as build_index_run
from pipelines.encode import run as encode_run
from pipelines.rerank import run as rerank_run
from pipelines.stage import run as stage_run
from tests.helpers_model import tiny_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FEATURE_DIM = 16

#: The flags of docker/README.md's Dataflow command lines, with a test project, plus --dry_run=True.
#: (--dry_run takes a value: Beam's TestOptions reads any non-empty string, even "False", as true.)
WORKER_IMAGE = "us-central1-docker.pkg.dev/rr-test/rr/rerank-retrieval-worker:2.77.0-cpu"
DATAFLOW_ARGS = ("--runner=DataflowRunner", "--dry_run=True", "--project=rr-test", "--region=us-central1",
                 "--temp_location=gs://rr-test/tmp", f"--sdk_container_image={WORKER_IMAGE}")
GPU_ARGS = ("--device", "cuda", "--model-copies", "1",
            "--dataflow_service_options=worker_accelerator=type:nvidia-l4;count:1;install-nvidia-driver")

MANIFEST = f"""
name: dataflow_tiny
feature_dim: {FEATURE_DIM}
max_regions: 12
collections:
  syn:
    images: {{format: synthetic, num_images: 16, seed: 3, min_regions: 4, max_regions: 10,
             splits: {{train: 0.5, test: 0.5}}}}
    captions: {{format: synthetic, captions_per_image: 2}}
    expected_images: 16
"""


def invoke(main, args):
    return CliRunner().invoke(main, [str(a) for a in args])


def files_under(directory) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), directory)
                  for d, _, names in os.walk(directory) for f in names)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A staged collection, a tiny model, its test-split embeddings and a Flat image index (DirectRunner)."""
    root = tmp_path_factory.mktemp("dataflow")
    manifest = root / "tiny.yaml"
    manifest.write_text(MANIFEST)
    staged, model, emb, index = (root / name for name in ("staged", "model", "emb", "index"))
    tiny_model(str(root / "bert"), feature_dim=FEATURE_DIM).save(str(model))
    for main, args in ((stage_run.main, ["--manifest", manifest, "--output", staged]),
                       (encode_run.main, ["--staged", staged, "--model", model, "--output", emb, "--split", "test",
                                          "--batch-size", 8]),
                       (build_index_run.main, ["--embeddings", emb, "--output", index, "--modality", "image",
                                               "--index-factory", "Flat"])):
        res = invoke(main, args)
        assert res.exit_code == 0, (main.name, res.output, res.exception)
    return SimpleNamespace(root=root, manifest=manifest, staged=staged, model=model, emb=emb, index=index)


def require_dataflow_extra() -> None:
    try:
        import apache_beam.runners.dataflow.internal.apiclient  # noqa: F401
    except ImportError as exc:  # a failure, not a skip: without it this CI check would check nothing
        pytest.fail(f"DataflowRunner needs apache-beam[gcp] ({exc}): pip install -e '.[test]'")


@pytest.fixture
def translated_jobs(monkeypatch):
    """The Dataflow jobs translated while the test runs (DataflowRunner.run_pipeline, recorded, not replaced);
    any socket use fails meanwhile."""
    require_dataflow_extra()
    from apache_beam.runners.dataflow.dataflow_runner import DataflowRunner

    jobs = []
    translate = DataflowRunner.run_pipeline

    def recording(self, pipeline, options, pipeline_proto=None):
        result = translate(self, pipeline, options, pipeline_proto)
        jobs.append(result.job)
        return result

    def offline(*args, **kwargs):
        raise OSError(f"network use during a Dataflow dry run: {args[1:] or args}")

    monkeypatch.setattr(DataflowRunner, "run_pipeline", recording)
    monkeypatch.setattr(socket.socket, "connect", offline)
    monkeypatch.setattr(socket.socket, "connect_ex", offline)
    monkeypatch.setattr(socket, "getaddrinfo", offline)
    return jobs


def pipeline_cli(name: str, a, out) -> tuple:
    return {
        "stage": (stage_run.main, ["--manifest", a.manifest, "--output", out]),
        "encode": (encode_run.main, ["--staged", a.staged, "--model", a.model, "--output", out, *GPU_ARGS]),
        "build_index": (build_index_run.main, ["--embeddings", a.emb, "--output", out, "--modality", "image",
                                           "--index-factory", "Flat"]),
        "rerank": (rerank_run.main, ["--staged", a.staged, "--embeddings", a.emb, "--index", a.index,
                                 "--ce-model", a.model, "--mode", "co", "--k", 5, "--output", out, *GPU_ARGS]),
    }[name]


def worker_images(proto) -> set[str]:
    from apache_beam.portability import common_urns
    from apache_beam.portability.api import beam_runner_api_pb2

    envs = proto.components.environments.values()
    assert all(env.urn == common_urns.environments.DOCKER.urn for env in envs), "Dataflow runs Docker only"
    return {beam_runner_api_pb2.DockerPayload.FromString(env.payload).container_image for env in envs}


def worker_side_functions(proto) -> list:
    """Unpickle every DoFn / CombineFn of a translated job, as a Dataflow worker would."""
    from apache_beam.internal import pickler
    from apache_beam.portability import common_urns, python_urns
    from apache_beam.portability.api import beam_runner_api_pb2

    fns = []
    for t in proto.components.transforms.values():
        if t.spec.urn == common_urns.primitives.PAR_DO.urn:
            spec = beam_runner_api_pb2.ParDoPayload.FromString(t.spec.payload).do_fn
        elif t.spec.urn in (common_urns.composites.COMBINE_PER_KEY.urn, common_urns.composites.COMBINE_GLOBALLY.urn):
            spec = beam_runner_api_pb2.CombinePayload.FromString(t.spec.payload).combine_fn
        else:
            continue
        if spec.urn in (python_urns.PICKLED_DOFN_INFO, python_urns.PICKLED_COMBINE_FN):
            fns.append(pickler.loads(spec.payload))
    return fns


@pytest.mark.parametrize("name", ["stage", "encode", "build_index", "rerank"])
def test_pipeline_translates_for_dataflow_offline(name, inputs, translated_jobs, tmp_path):
    out = tmp_path / "out"
    main, args = pipeline_cli(name, inputs, out)
    res = invoke(main, [*args, *DATAFLOW_ARGS])

    want = 2 if name == "rerank" else 1  # rerank: its search job, then its waves' graph
    assert len(translated_jobs) == want, (f"{name}: expected {want} Dataflow job(s) translated, got "
                                          f"{len(translated_jobs)}", res.output, res.exception)
    for job in translated_jobs:
        proto = job.proto_pipeline
        assert worker_images(proto) == {WORKER_IMAGE}, f"{name}: every step must run in --sdk_container_image"
        fns = worker_side_functions(proto)
        assert len(fns) >= 3, f"{name}: only {len(fns)} DoFns/CombineFns in the translated job"
    if name in ("encode", "rerank"):  # the model steps: RunInference with our handler
        proto = translated_jobs[-1].proto_pipeline
        assert any("RunInference" in t.unique_name for t in proto.components.transforms.values()), name

    # The launcher must stop after a dry run: exit 0, say so, write nothing (it has no outputs to read).
    assert res.exit_code == 0, (f"{name}: the launcher failed after the dry run", res.output, res.exception)
    assert "dry run" in res.output.lower(), res.output
    written = files_under(out) if out.exists() else []
    assert written == [], f"{name} wrote {written} on a dry run"


def run_python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


def test_stage_help_prints_no_apitools_warning():
    res = subprocess.run([sys.executable, "-m", "pipelines.stage", "-h"], cwd=REPO, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONPATH": REPO})
    assert res.returncode == 0 and "Usage:" in res.stdout, res.stderr
    assert "apitools" not in res.stderr, res.stderr


def test_apitools_warning_dropped_when_the_gcp_extras_are_absent():
    # Beam logs the warning where `apitools` does not import; block it to be sure the guard is exercised.
    res = run_python("""
        import logging, sys
        sys.modules["apitools"] = None  # as without apache-beam[gcp]
        import pipelines.stage.run
        assert "apache_beam.io.gcp.internal.clients.bigquery" in sys.modules  # the module that warns
        root = logging.getLogger()
        print("root handlers", len(root.handlers), "filters", len(root.filters))
        sys.argv = ["pipelines.stage", "-h"]
        pipelines.stage.run.main()
    """)
    assert res.returncode == 0 and "Usage:" in res.stdout, res.stderr
    assert "apitools" not in res.stderr, res.stderr
    # nothing left behind: no basicConfig() side effect that would mute the CLIs' own logging set-up
    assert "root handlers 0 filters 0" in res.stdout, res.stdout
