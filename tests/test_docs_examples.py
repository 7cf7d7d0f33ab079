"""Every ```python block of the README and of the docs pages runs, at debug size.

Blocks are found, not listed: a new block in README.md or docs/**/*.md is run without a
change here. Each block runs in a fresh namespace, in order, in a stand-in project:

- relative paths resolve against the project root (`specrank.settings.paths.project_path`, and
  `sqlite:///relative.db` tracking URIs), as they do for every command; here the root is a
  temporary folder holding the tiny fixtures below, with the real `conf/` linked in;
- `data_out/traces` is a small synthetic trace store (the default `paths.traces`);
- `mlflow.db` is an MLflow store with one run whose `rerankers/rows_lgbm_T0_fold0` is a
  greedy `rows` reranker fitted on a small synthetic candidate table (as
  tests/test_online_reranker_load.py fits one);
- relative paths a library resolves itself (`trace_store("data_out/traces")`) resolve
  against the working directory, which is that folder too;
- a placeholder in angle brackets is filled in (`<run id>`: that run's id, `<folder>`:
  the reranker's local folder, `<dir>`: the trace store); a block naming any other
  placeholder fails.

A block that cannot run at debug size (real weights, a GPU) carries
`<!-- example: not-run (why) -->` on the line before its fence; it must be listed in
`NOT_RUN` with that reason, and is still compiled. Nothing else is skipped: a block that
raises fails its test.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pytest

import specrank.settings.paths
import specrank.tracking.train_runs
from rerank.fit.models import FittedReranker, fit_reranker
from rerank.fit.persist import save_reranker
from rerank.serving import OnlinePredictor
from tests.candidate_frames import FAST, make_candidate_frame
from tests.tiny_models import one_thread

ROOT = Path(__file__).resolve().parents[1]
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")))
NOT_RUN_TAG = re.compile(r"<!--\s*example:\s*not-run\s*\((?P<why>[^)]*)\)\s*-->")
FENCE = re.compile(
    r"^(?P<indent>[ \t]*)```(?:python|py)[ \t]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.S | re.M
)
PLACEHOLDER = re.compile(r"<([a-z][a-z ]*[a-z])>")
RERANKER = "rows_lgbm_T0_fold0"
# What the pages tag not-run, and why: a new not-run block must be added here on purpose.
NOT_RUN: dict[str, str] = {}
# The type of a name a block binds, where the block binds it: it ran on the fixtures, not
# only without an error.
BINDS = {"model": FittedReranker, "predictor": OnlinePredictor, "rounds": pa.Table}


@dataclass(frozen=True)
class Example:
    page: str  # relative to the repository root
    line: int  # of the opening fence
    code: str
    not_run: str | None  # the reason, when tagged not-run

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def examples(pages=PAGES, root: Path = ROOT) -> list[Example]:
    """Every ```python (or ```py) block of `pages`, with its not-run tag if any."""
    found = []
    for page in pages:
        text = page.read_text()
        for m in FENCE.finditer(text):
            before = text[: m.start()].rstrip().rsplit("\n", 1)[-1].strip()
            tag = NOT_RUN_TAG.fullmatch(before)
            indent = len(m["indent"])
            code = "".join(line[indent:] for line in m["body"].splitlines(keepends=True))
            found.append(
                Example(
                    str(page.relative_to(root)),
                    text.count("\n", 0, m.start()) + 1,
                    code,
                    tag["why"].strip() if tag else None,
                )
            )
    return found


EXAMPLES = examples()


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A stand-in project root with the fixtures; the placeholders' values."""
    import mlflow

    from recipes.synth.config import SynthConfig, SynthJobConfig
    from recipes.synth.job import write_synthetic_traces
    from tree.config import PoolConfig, SelectConfig

    root = tmp_path_factory.mktemp("project")
    (root / "conf").symlink_to(ROOT / "conf")
    traces = root / "data_out" / "traces"
    job = SynthJobConfig(toy_prompts=4, rounds_per_prompt=4, prompts_per_shard=2)
    pool, select = (
        PoolConfig(top_k=4, expand_steps=2, expand=4),
        SelectConfig(budget=4, record_top_m=8),
    )
    write_synthetic_traces(traces, job, pool, select, SynthConfig(), seed=3)
    frame = make_candidate_frame(n_prompts=12, rounds=4, temperature=0.0, seed=4)
    with one_thread():
        model = fit_reranker(frame, "rows", "lgbm", "greedy", n_threads=1, capacity=FAST)
    folder = save_reranker(model, root / "rerankers" / RERANKER)
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    exp = client.create_experiment("train", artifact_location=(root / "artifacts").as_uri())
    run_id = client.create_run(exp).info.run_id
    client.log_artifacts(run_id, str(folder), f"rerankers/{RERANKER}")
    client.set_terminated(run_id)
    return root, {"run id": run_id, "folder": str(folder), "dir": str(traces)}


def fill(code: str, values: dict[str, str]) -> str:
    """`code` with each `<placeholder>` replaced by its value; an unknown one fails."""
    unknown = sorted({p for p in PLACEHOLDER.findall(code) if p not in values})
    assert not unknown, f"placeholders with no value: {unknown}"
    return PLACEHOLDER.sub(lambda m: values[m[1]], code)


def test_the_examples_are_found():
    names = {e.page for e in EXAMPLES}
    assert {"README.md", "docs/api.md", "docs/guide/online.md"} <= names
    assert {e.name: e.not_run for e in EXAMPLES if e.not_run is not None} == NOT_RUN


def test_the_extractor_reads_tags_indents_and_other_fences(tmp_path):
    page = tmp_path / "p.md"
    page.write_text(
        "```bash\nls\n```\n<!-- example: not-run (needs a GPU) -->\n```python\nx = 1\n```\n"
        "!!! note\n    ```py\n    y = <dir>\n    ```\n```python\nz = 3\n```\n"
    )
    found = examples([page], tmp_path)
    assert [(e.line, e.code, e.not_run) for e in found] == [
        (5, "x = 1\n", "needs a GPU"),
        (9, "y = <dir>\n", None),
        (12, "z = 3\n", None),
    ]
    assert fill(found[1].code, {"dir": "'/d'"}) == "y = '/d'\n"
    with pytest.raises(AssertionError, match=r"\['folder'\]"):
        fill("f(<folder>)", {"dir": "/d"})
    assert fill("a < b and c > d", {}) == "a < b and c > d"  # not a placeholder


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.name for e in EXAMPLES])
def test_the_example_runs(example, project, monkeypatch):
    code = compile(example.code, example.name, "exec")  # a not-run block still compiles
    if example.not_run is not None:
        assert example.not_run, f"{example.name}: a not-run tag needs its reason"
        assert NOT_RUN.get(example.name) == example.not_run
        return
    root, values = project
    code = compile(fill(example.code, values), example.name, "exec")
    monkeypatch.setattr(specrank.settings.paths, "PROJECT_ROOT", root)
    monkeypatch.setattr(specrank.tracking.train_runs, "PROJECT_ROOT", root)
    monkeypatch.chdir(root)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
    namespace: dict = {"__name__": "__docs_example__"}
    with one_thread():
        exec(code, namespace)  # the docs' own example, on the fixtures
    for name, kind in BINDS.items():
        if name in namespace:
            assert isinstance(namespace[name], kind), (name, type(namespace[name]))
