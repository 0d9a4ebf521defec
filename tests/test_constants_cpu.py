"""python/tpcomm/_constants.py is what scripts/gen_constants.py makes of
csrc/tpcomm.h: a header change that was not regenerated fails here."""
import importlib.util
import os

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


def test_the_module_holds_the_values_the_python_side_uses():
    assert (_constants.TPC_OK, _constants.TPC_ERR_CLOSED) == (0, 8)
    assert {_constants.TPC_ALGO_PACKET, _constants.TPC_ALGO_BULK, _constants.TPC_ALGO_LINE} == {1, 2, 3}
    assert _constants.TPC_MAX_RANKS == 8
