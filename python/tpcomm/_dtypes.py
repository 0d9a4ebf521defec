"""The dtypes tpcomm's reducing kernels take, by torch dtype: their names (as
routing tables and Config write them) and their tpc_dtype codes (csrc/tpcomm.h,
through the generated _constants). Every other module reads them from here."""
import torch

from . import _constants as C

REDUCIBLE = (torch.float32, torch.float16, torch.bfloat16)
NAME = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
NAMES = tuple(NAME[d] for d in REDUCIBLE)
CODE = {torch.float32: C.TPC_FLOAT32, torch.float16: C.TPC_FLOAT16, torch.bfloat16: C.TPC_BFLOAT16}
