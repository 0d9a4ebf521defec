"""README.md and docs/ hold what the code and the committed results say:

* the README stays a user's page (at most 250 lines);
* every generated block (README's headline, docs/benchmarks.md's tables)
  is what scripts/benchmark_tables.py makes of benchmarks/results/*.json,
  and the headline's cells equal the JSON's rows, read here independently;
* every relative link in README.md and docs/*.md resolves, anchors included;
* every file, python command, tpcomm name, torch op and Communicator method
  the README names exists.
"""
import importlib
import importlib.util
import json
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
DOCS = os.path.join(ROOT, "docs")
MARKDOWN = [README] + sorted(os.path.join(DOCS, f) for f in os.listdir(DOCS) if f.endswith(".md"))

def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def _tables_script():
    spec = importlib.util.spec_from_file_location("benchmark_tables", os.path.join(ROOT, "scripts",
                                                                                   "benchmark_tables.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _code(text):
    """Every inline code span and fenced block of a Markdown text."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.DOTALL | re.MULTILINE)
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)
    return blocks + re.findall(r"`([^`\n]+)`", prose)


# ------------------------------------------------------------------ size
def test_readme_is_at_most_250_lines():
    n = len(_read(README).splitlines())
    assert n <= 250, f"README.md has {n} lines; engineers' material belongs in docs/"


# ---------------------------------------------------- generated tables
def test_generated_blocks_match_the_committed_json():
    tables = _tables_script()
    names = set()
    for rel in tables.DOCUMENTS:
        text = _read(os.path.join(ROOT, rel))
        names.update(tables.block_names(text))
        assert tables.regenerate(text) == text, f"{rel} is stale: run python scripts/benchmark_tables.py"
    expected = {"headline", "decode-headline", "tables-h200x2", "tables-h200x4", "environment-h200x2",
                "environment-h200x4", "host-cost", "tp-decode", "add-rms-norm-routes", "scaling-model"}
    assert expected <= names, f"generated blocks missing: {sorted(expected - names)}"


def test_check_mode_reports_a_stale_block(tmp_path, monkeypatch):
    tables = _tables_script()
    stale = _read(README).replace("| 64 B | ", "| 64 B | 9", 1)
    (tmp_path / "README.md").write_text(stale)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "benchmarks.md").write_text(_read(os.path.join(DOCS, "benchmarks.md")))
    monkeypatch.setattr(tables, "ROOT", str(tmp_path))
    assert tables.main(["--check"]) == 1
    assert (tmp_path / "README.md").read_text() == stale  # --check changes nothing
    assert tables.main([]) == 0
    assert (tmp_path / "README.md").read_text() == _read(README)


def _headline_rows():
    text = _read(README)
    block = text.split("<!-- generated: headline -->", 1)[1].split("<!-- /generated: headline -->", 1)[0]
    rows = [line for line in block.splitlines() if line.startswith("| ") and line[2].isdigit()]
    return {r.split("|")[1].strip(): [c.strip().strip("*") for c in r.split("|")[2:-1]] for r in rows}


@pytest.mark.parametrize("world,first_column", [(2, 0), (4, 4)])
def test_headline_cells_are_the_json_rows(world, first_column):
    """Read straight from the JSON: tpcomm, NCCL's default, the fastest NCCL
    configuration and torch's two-shot, bf16 all_reduce, graph mode."""
    with open(os.path.join(ROOT, "benchmarks", "results", f"h200x{world}.json")) as f:
        rows = json.load(f)["rows"]
    headline = _headline_rows()
    sizes = sorted({r["bytes_per_rank"] for r in rows})
    assert len(headline) == len(sizes) == 11
    for n, label in zip(sizes, headline):
        cell = {r["backend"]: r["median_us"] for r in rows
                if (r["op"], r["dtype"], r["mode"], r["bytes_per_rank"]) == ("all_reduce", "bfloat16", "graph", n)}
        best = min(cell[b] for b in ("nccl", "nccl_nomix", "nccl_window", "nccl_window_nomix"))
        want = [f"{cell['tpcomm']:.2f}", f"{cell['nccl']:.2f}", f"{best:.2f}", f"{cell['symm_two_shot']:.2f}"]
        assert headline[label][first_column:first_column + 4] == want, label


# --------------------------------------------------------------- links
def _slug(heading):
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _links(path):
    text = re.sub(r"^```.*?^```", "", _read(path), flags=re.DOTALL | re.MULTILINE)
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: os.path.relpath(p, ROOT))
def test_relative_links_resolve(path):
    assert _links(path), f"{path}: no links found (the pattern is broken)"
    for link in _links(path):
        if re.match(r"[a-z]+:", link):
            continue
        target, _, anchor = link.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(path), target)) if target else path
        assert os.path.exists(resolved), f"{os.path.relpath(path, ROOT)}: {link} does not resolve"
        if anchor and resolved.endswith(".md"):
            slugs = {_slug(h) for h in re.findall(r"^#+ (.+)$", _read(resolved), re.MULTILINE)}
            assert anchor in slugs, f"{os.path.relpath(path, ROOT)}: no heading for #{anchor} in {target or 'itself'}"


def test_slug_follows_github():
    assert _slug("Host cost of an eager call") == "host-cost-of-an-eager-call"
    assert _slug("The fused op's routes") == "the-fused-ops-routes"
    assert _slug("`tpcomm.Communicator` API") == "tpcommcommunicator-api"


# ---------------------------------------------- what the README names
def _readme_code():
    return "\n".join(_code(_read(README)))


def _repo_paths():
    found = re.findall(r"(?<![\w/.])((?:examples|scripts|benchmarks|docs|tests|csrc|python|\.ci)/[\w./<>-]*\w)",
                       _readme_code())
    return sorted(set(found))


def test_readme_names_repository_files():
    paths = _repo_paths()
    assert "examples/quickstart.py" in paths
    for p in paths:
        where = p.split("<", 1)[0].rsplit("/", 1)[0] if "<" in p else p  # a pattern: its folder exists
        assert os.path.exists(os.path.join(ROOT, where)), f"README.md names {p}, which does not exist"


def _python_modules():
    return sorted(set(re.findall(r"\bpython -m ([\w.]+)", _readme_code())))


def test_readme_runs_known_python_modules():
    assert {"tpcomm.bench", "pytest"} <= set(_python_modules())


@pytest.mark.parametrize("module", _python_modules())
def test_readme_python_module_exists(module):
    found = importlib.util.find_spec(module) is not None
    assert found, f"README.md runs python -m {module}, which is not importable"


def _tpcomm_names():
    names = set(re.findall(r"(?<![\w.])(tpcomm(?:\.[A-Za-z_]\w*)+)", _readme_code()))
    return sorted(n for n in names if not n.endswith((".py", ".json")))


def _resolve(name):
    """The object a dotted tpcomm name refers to (importing submodules as needed), or None."""
    parts = name.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        try:
            obj = importlib.import_module(".".join(parts[:i + 1]))
        except ImportError:
            return None
    return obj


@pytest.mark.parametrize("name", _tpcomm_names())
def test_readme_tpcomm_name_exists(name):
    found = _resolve(name) is not None
    assert found, f"README.md names {name}, which tpcomm does not have"


def test_readme_torch_ops_are_registered():
    torch = pytest.importorskip("torch")
    importlib.import_module("tpcomm")
    ops = sorted(set(re.findall(r"torch\.ops\.tpcomm\.(\w+)", _readme_code())))
    assert {"custom_all_reduce", "custom_all_gather", "custom_reduce_scatter", "custom_all_reduce_add_rms_norm"} <= set(ops)
    for op in ops:
        assert hasattr(torch.ops.tpcomm, op), f"README.md names torch.ops.tpcomm.{op}, which is not registered"


def test_readme_communicator_methods_exist():
    communicator = _resolve("tpcomm.Communicator")
    table = re.findall(r"^\| (`.+?) \| ", _read(README), re.MULTILINE)
    methods = {m for row in table for m in re.findall(r"`(\w+)\(", row)}
    assert {"all_reduce", "all_gather", "reduce_scatter", "capture", "stats", "close", "abort"} <= methods
    for m in sorted(methods):
        assert callable(getattr(communicator, m, None)), f"README.md lists Communicator.{m}, which is not a method"
