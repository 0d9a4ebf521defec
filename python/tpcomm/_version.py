"""tpcomm's version: the one place it is written. setup.py reads it (and adds
a local label naming the CUDA or ROCm the wheel was built for, e.g.
0.1.0+cu130); tpcomm.__version__ is this value without the label."""
__version__ = "0.2.0"
