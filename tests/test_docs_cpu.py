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
    expected = {"headline", "norm-fp8-probe", "decode-headline", "tables-h200x2", "tables-h200x4", "environment-h200x2",
                "environment-h200x4", "tp-decode", "add-rms-norm-routes", "scaling-model", "transformers-versions"}
    assert expected <= names, f"generated blocks missing: {sorted(expected - names)}"


def test_check_mode_reports_a_stale_block(tmp_path, monkeypatch):
    tables = _tables_script()
    stale = _read(README).replace("| 64 B | ", "| 64 B | 9", 1)
    (tmp_path / "README.md").write_text(stale)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "benchmarks.md").write_text(_read(os.path.join(DOCS, "benchmarks.md")))
    (tmp_path / "docs" / "testing.md").write_text(_read(os.path.join(DOCS, "testing.md")))
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


def test_headline_cells_are_the_json_rows():
    """Read straight from the 2-rank JSON: tpcomm, NCCL's default, the fastest
    NCCL configuration and torch's two-shot, bf16 all_reduce, graph mode; a
    tpcomm figure above the default max_bytes carries the mark of the raised cap."""
    from tpcomm.config import Config

    with open(os.path.join(ROOT, "benchmarks", "results", "h200x2.json")) as f:
        data = json.load(f)
    rows = data["rows"]
    headline = _headline_rows()
    sizes = sorted({r["bytes_per_rank"] for r in rows})
    assert len(headline) == len(sizes) == 11
    marked = []
    for n, label in zip(sizes, headline):
        cell = {r["backend"]: r["median_us"] for r in rows
                if (r["op"], r["dtype"], r["mode"], r["bytes_per_rank"]) == ("all_reduce", "bfloat16", "graph", n)}
        best = min(cell[b] for b in ("nccl", "nccl_nomix", "nccl_window", "nccl_window_nomix"))
        want = [f"{cell['tpcomm']:.2f}", f"{cell['nccl']:.2f}", f"{best:.2f}", f"{cell['symm_two_shot']:.2f}"]
        got = headline[label][:4]
        if got[0].endswith(" †"):
            marked.append(n)
            got[0] = got[0][:-2].strip("*")
        assert got == want, label
    assert marked == [n for n in sizes if n > Config().max_bytes] != []
    assert data["env"]["tpcomm_max_bytes"] > Config().max_bytes
    assert "† with `max_bytes` raised to 128 MiB (`TPCOMM_MAX_BYTES`); by default (16 MiB)" in _read(README)


def test_readme_names_the_transformers_versions_run():
    """README's Support row names the transformers versions of the committed
    CPU runs (docs/testing.md's table), oldest first: those CI installs
    beside its venv (.ci/transformers_versions.sh) and the venv's, newer."""
    with open(os.path.join(ROOT, "benchmarks", "results", "transformers_versions_cpu.json")) as f:
        runs = json.load(f)["runs"]
    with open(os.path.join(ROOT, ".ci", "transformers_versions.sh")) as f:
        side = re.search(r'^VERSIONS="([^"]*)"$', f.read(), re.MULTILINE).group(1).split()
    row = next(line for line in _read(README).splitlines() if line.startswith("| transformers "))
    key = lambda v: tuple(int(p) for p in v.split("."))  # noqa: E731
    assert re.findall(r"\d+\.\d+\.\d+", row.split("|")[1]) == sorted(runs, key=key), row
    newest = sorted(runs, key=key)[-1]
    assert sorted(side, key=key) == sorted(set(runs) - {newest}, key=key) and key(newest) > max(map(key, side))


def test_headline_shows_only_the_current_kernels_run():
    text = _read(README)
    block = text.split("<!-- generated: headline -->", 1)[1].split("<!-- /generated: headline -->", 1)[0]
    assert "TP4" not in block and "4×H200" not in block


def test_benchmark_plots_are_shown_as_images():
    text = _read(os.path.join(ROOT, "docs", "benchmarks.md"))
    images = re.findall(r"!\[[^\]]*\]\(([^)]+\.(?:png|svg))\)", text)
    assert len(images) >= 8, images
    for image in images:
        assert os.path.exists(os.path.normpath(os.path.join(ROOT, "docs", image))), image


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
    assert "pytest" in _python_modules()


def test_readme_says_how_to_build_the_wheels():
    """No wheel is published: README's Support names the script and the variables it reads."""
    text = _read(README)
    with open(os.path.join(ROOT, ".ci", "wheel.sh")) as f:
        script = f.read()
    for variant in ("cu130", "cu128"):
        assert f"`bash .ci/wheel.sh {variant} dist/`" in text, variant
        assert f"{variant})" in script, variant
    for variable in ("PY", "CUDA_HOME", "AUDITWHEEL", "TORCH_CUDA_ARCH_LIST_WHEEL"):
        assert f"`{variable}`" in text and re.search(rf"\b{variable}\b", script), variable


def test_readme_runs_known_tpcomm_commands():
    from tpcomm import cli

    commands = set(re.findall(r"(?:^|&& |; )tpcomm ([a-z]+)\b", _readme_code(), re.MULTILINE))
    assert "bench" in commands, "README's main command runs the benchmark (tpcomm bench)"
    assert commands <= set(cli.COMMANDS), f"README runs tpcomm {sorted(commands - set(cli.COMMANDS))}"


@pytest.mark.parametrize("module", _python_modules())
def test_readme_python_module_exists(module):
    found = importlib.util.find_spec(module) is not None
    assert found, f"README.md runs python -m {module}, which is not importable"


def test_every_alternative_names_another_command():
    """`A` (or `B`): B is another way to run A, never A again, and a
    `python -m` alternative imports."""
    for path in MARKDOWN:
        for first, other in re.findall(r"`([^`\n]+)` \(or `([^`\n]+)`\)", _read(path)):
            assert first != other, f"{os.path.relpath(path, ROOT)}: `{first}` (or `{other}`)"
            module = re.match(r"python -m ([\w.]+)", other)
            if module:
                assert importlib.util.find_spec(module.group(1)) is not None, (path, other)


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
