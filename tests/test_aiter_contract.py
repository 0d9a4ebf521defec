"""Everything tpcomm's AITER adapter calls exists, with those parameters, in
the pinned amd-aiter wheel: its custom_all_reduce.py is parsed (not imported;
`import aiter` builds HIP code and needs a ROCm machine). The wheel comes from
PyPI (pip download); outside CI a machine without network skips."""
import ast

import pytest

from pinned_wheel import read_sources
from tpcomm.backends import aiter as aiter_backend

SOURCE = aiter_backend.AITER_MODULE.replace(".", "/") + ".py"


@pytest.fixture(scope="module")
def aiter_source(tmp_path_factory):
    return read_sources(aiter_backend.PINNED_WHEEL, [SOURCE], tmp_path_factory.mktemp("aiter"), pip_args=("--pre",),
                        timeout=600)[SOURCE]


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


def contract_mismatches(source, contract):
    """What in `contract` (class -> method -> the parameters the adapter
    passes, in order) the module `source` does not provide: [] when it
    provides everything (extra trailing parameters are allowed)."""
    found, out = _signatures(source), []
    for cls, methods in contract.items():
        if cls not in found:
            out.append(f"no class {cls}")
            continue
        for method, params in methods.items():
            if method not in found[cls]:
                out.append(f"{cls} has no method {method}")
            elif list(params) != found[cls][method][:len(params)]:
                out.append(f"{cls}.{method}: the adapter passes {list(params)}, AITER takes {found[cls][method]}")
    return out


def test_every_call_of_the_adapter_exists_in_the_pinned_wheel(aiter_source):
    assert contract_mismatches(aiter_source, aiter_backend.CONTRACT) == [], SOURCE


def test_capture_is_a_context_manager(aiter_source):
    tree = ast.parse(aiter_source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CustomAllreduce")
    capture = next(f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "capture")
    names = {ast.unparse(d) for d in capture.decorator_list}
    assert any("contextmanager" in n for n in names), names


# Hand-written modules against a hand-written contract: the check passes what
# provides every call, and names each way a module can stop providing one.
_CONTRACT = {"CustomAllreduce": {"__init__": ("group", "device", "max_size"), "should_custom_ar": ("inp",),
                                 "close": ()}}
_PROVIDES = """
class Helper:
    def should_custom_ar(self, tensor):
        pass

class CustomAllreduce:
    def __init__(self, group, device, max_size=8192 * 1024, enable_register_for_capturing=True):
        pass

    def should_custom_ar(self, inp):
        pass

    def close(self):
        pass
"""


@pytest.mark.parametrize("change,mismatch", [
    (("def should_custom_ar(self, inp)", "def should_custom_ar(self, tensor)"),
     "CustomAllreduce.should_custom_ar: the adapter passes ['inp'], AITER takes ['tensor']"),
    (("self, group, device, max_size=", "self, device, group, max_size="),
     "CustomAllreduce.__init__: the adapter passes ['group', 'device', 'max_size'], AITER takes "
     "['device', 'group', 'max_size', 'enable_register_for_capturing']"),
    (("    def close(self):\n        pass\n", ""), "CustomAllreduce has no method close"),
    (("class CustomAllreduce:", "class CustomAllReduce:"), "no class CustomAllreduce"),
])
def test_the_check_names_what_a_changed_module_lacks(change, mismatch):
    assert contract_mismatches(_PROVIDES, _CONTRACT) == []
    old, new = change
    assert old in _PROVIDES
    assert contract_mismatches(_PROVIDES.replace(old, new), _CONTRACT) == [mismatch]


def test_absent_on_cuda():
    ok, why = aiter_backend.available()
    assert not ok and "ROCm" in why
    with pytest.raises(RuntimeError, match="ROCm"):
        aiter_backend.AiterAllReduce(None, "cuda:0", 1 << 20)
