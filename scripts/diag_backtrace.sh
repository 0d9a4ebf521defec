#!/usr/bin/env bash
# Device diagnostic: native backtrace of an exception thrown from a tpcomm op.
cat > /tmp/throw.py <<'PY'
import torch, tpcomm
tpcomm.load()
torch.ops.tpcomm.custom_all_reduce(torch.ones(4, device="cuda"), 0, 0)
PY
timeout 120 cuda-gdb -q -batch -ex "set pagination off" -ex "set cuda api_failures ignore" -ex run -ex bt -ex "info sharedlibrary" --args python3 /tmp/throw.py 2>&1 | grep -v "^\[New Thread\|^\[Thread\|Detaching\|^\[Inferior" | grep -E "^#|signal|SIG|libstdc|libgcc|_C.abi3|Error" | head -60
