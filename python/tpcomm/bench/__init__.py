"""tpcomm.bench: tpcomm's kernels against NCCL and torch's symmetric memory.

python -m tpcomm.bench runs the comparison (see __main__.py);
python -m tpcomm.bench.plots RESULTS.json redraws the figures of a results file.
"""
