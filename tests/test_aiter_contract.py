"""Everything tpcomm's AITER adapter calls exists, with those parameters, in
the pinned amd-aiter wheel: its custom_all_reduce.py is parsed (not imported;
`import aiter` builds HIP code and needs a ROCm machine). The wheel comes from
PyPI (pip download); outside CI a machine without network skips."""
import ast
import os
import subprocess
import sys
import zipfile

import pytest

from tpcomm.backends import aiter as aiter_backend

SOURCE = aiter_backend.AITER_MODULE.replace(".", "/") + ".py"


@pytest.fixture(scope="module")
def aiter_source(tmp_path_factory):
    where = tmp_path_factory.mktemp("aiter")
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--pre", "--no-deps", "--quiet", "-d", str(where),
                           aiter_backend.PINNED_WHEEL], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        if os.environ.get("CI") == "true":
            pytest.fail(f"could not download {aiter_backend.PINNED_WHEEL}: {proc.stderr[-2000:]}")
        pytest.skip(f"could not download {aiter_backend.PINNED_WHEEL} (no network?)")
    wheel = next(where.glob("*.whl"))
    with zipfile.ZipFile(wheel) as z:
        return z.read(SOURCE).decode()


def _signatures(source):
    """{class: {method: [parameter names without self]}} of a module's source."""
    out = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef):
            methods = {}
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    args = item.args
                    names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
                    methods[item.name] = [n for n in names if n != "self"]
            out[node.name] = methods
    return out


def test_every_call_of_the_adapter_exists_in_the_pinned_wheel(aiter_source):
    found = _signatures(aiter_source)
    for cls, methods in aiter_backend.CONTRACT.items():
        assert cls in found, f"{SOURCE} has no class {cls}"
        for method, params in methods.items():
            assert method in found[cls], f"{cls} has no method {method}"
            have = found[cls][method]
            assert list(params) == have[:len(params)], f"{cls}.{method}: adapter passes {params}, AITER takes {have}"


def test_capture_is_a_context_manager(aiter_source):
    tree = ast.parse(aiter_source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CustomAllreduce")
    capture = next(f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "capture")
    names = {ast.unparse(d) for d in capture.decorator_list}
    assert any("contextmanager" in n for n in names), names


def test_signature_reader_sees_a_change():
    """The check has teeth: a renamed parameter is seen."""
    changed = "class CustomAllreduce:\n    def should_custom_ar(self, tensor):\n        pass\n"
    assert _signatures(changed)["CustomAllreduce"]["should_custom_ar"] == ["tensor"]
    assert ["inp"] != _signatures(changed)["CustomAllreduce"]["should_custom_ar"][:1]


def test_absent_on_cuda():
    ok, why = aiter_backend.available()
    assert not ok and "ROCm" in why
    with pytest.raises(RuntimeError, match="ROCm"):
        aiter_backend.AiterAllReduce(None, "cuda:0", 1 << 20)
