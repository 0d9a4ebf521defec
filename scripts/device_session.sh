#!/usr/bin/env bash
# One device call for a latency change: the stage probe, build + GPU tests +
# benchmark (device_run.sh all, files under $OUT), then an interleaved A/B
# against .ab/base.tar (carry .ab). Probe and A/B print to stdout only, since
# $OUT is full with the benchmark's files.
set -u
nvcc -O3 -std=c++17 -arch=sm_90 -Icsrc benchmarks/latency_probe.cu -o /tmp/probe && timeout 60 /tmp/probe > /tmp/probe.txt 2>&1
TPCOMM_TEST_TIMEOUT_S=300 bash scripts/device_run.sh all 2>&1 | grep -E "TIMING|passed|failed|FAIL|Error|build:|done:" | tail -25
[ -f .ab/base.tar ] && bash scripts/ab_bench.sh .ab/base.tar "${AB_ROUNDS:-2}" 2>&1 | tail -40
cat /tmp/probe.txt
