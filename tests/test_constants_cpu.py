"""python/tpcomm/_constants.py is what scripts/gen_constants.py makes of
csrc/tpcomm.h: a header change that was not regenerated fails here."""
import importlib.util
import os
import shutil
import subprocess

import pytest

from tpcomm import _constants

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location("gen_constants", os.path.join(ROOT, "scripts", "gen_constants.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_constants_are_the_generated_ones(gen):
    with open(gen.OUTPUT) as f:
        assert f.read() == gen.generated(), "run python scripts/gen_constants.py"
    assert gen.main(["--check"]) == 0


def test_the_header_is_read_as_a_compiler_would(gen):
    """Macros with suffixes and parentheses, enum members with implicit
    values, comments anywhere; a member it cannot read raises."""
    header = ("#define TPC_A 16u /* sixteen */\n#define TPC_B (0x10)\n#define TPC_NOT_A_NUMBER (TPC_A * 2)\n"
              "typedef enum {\n  TPC_X = 3, /* three, = 9 in a comment */\n  TPC_Y, // four\n  TPC_Z = 7\n} tpc_e;\n")
    assert gen.constants(header) == [("#define", [("TPC_A", 16), ("TPC_B", 16)]),
                                     ("tpc_e", [("TPC_X", 3), ("TPC_Y", 4), ("TPC_Z", 7)])]
    with pytest.raises(ValueError, match="cannot read member"):
        gen.constants("typedef enum { TPC_X = 1 << 2 } tpc_e;")


def test_every_constant_is_the_value_a_c_compiler_gives(tmp_path):
    """The C compiler, not the script's reader, says what each name in the
    header is: a reader that misreads a value (a suffix, an implicit enum
    member) fails here even when the module is regenerated."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    names = [n for n in vars(_constants) if n.startswith("TPC_")]
    assert {"TPC_OK", "TPC_ERR_CLOSED", "TPC_ALGO_PACKET", "TPC_ALGO_BULK", "TPC_MAX_RANKS"} <= set(names)
    source = tmp_path / "values.c"
    source.write_text('#include <stdio.h>\n#include "tpcomm.h"\nint main(void) {\n' +
                      "".join(f'  printf("{n} %lld\\n", (long long)({n}));\n' for n in names) + "  return 0;\n}\n")
    subprocess.run([cc, "-I", os.path.join(ROOT, "csrc"), str(source), "-o", str(tmp_path / "values")], check=True)
    out = subprocess.run([str(tmp_path / "values")], check=True, capture_output=True, text=True).stdout
    compiled = {name: int(value) for name, value in (line.split() for line in out.splitlines())}
    assert compiled == {n: getattr(_constants, n) for n in names}


def test_every_algorithm_code_is_in_lib():
    """_lib.ALGO_* is every tpc_algo of the header (the quantized ones and the
    one-shot bulk included), read from _constants rather than copied."""
    from tpcomm import _lib

    algos = {name: value for name, value in vars(_constants).items() if name.startswith("TPC_ALGO_")}
    assert {"TPC_ALGO_QUANTIZED_FP8", "TPC_ALGO_QUANTIZED_INT4", "TPC_ALGO_BULK_ONE_SHOT"} <= set(algos)
    assert {name: getattr(_lib, name[len("TPC_"):]) for name in algos} == algos
