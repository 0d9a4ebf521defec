"""tpcomm.bench.scaling, the cost model behind docs/benchmarks.md's "What
the time grows with": what each kernel sends, and a fit that reproduces the
two sizes it is fitted at."""
import pytest

from tpcomm.bench import scaling

MiB = 1 << 20


def test_what_each_kernel_sends():
    s = 1 * MiB
    assert scaling.egress_bytes("packet", s, 4) == 6 * s          # 16-byte packets of 8 data bytes, 3 peers
    assert scaling.egress_bytes("line", s, 8) == 7 * s * 128 / 112
    assert scaling.egress_bytes("two_shot", s, 8) == 2 * (7 / 8) * s * 128 / 112
    assert scaling.egress_bytes("bulk", s, 2) == s                # the one-shot stream of two ranks
    assert scaling.egress_bytes("bulk", s, 4) == 2 * (3 / 4) * s  # the two-shot: the minimum
    # two_shot sends what line sends on two ranks, less from three on
    assert scaling.egress_bytes("two_shot", s, 2) == scaling.egress_bytes("line", s, 2)
    assert scaling.egress_bytes("two_shot", s, 3) < scaling.egress_bytes("line", s, 3)
    with pytest.raises(ValueError, match="no model for 'nccl'"):
        scaling.egress_bytes("nccl", s, 2)


def test_fit_reproduces_its_two_sizes():
    rows = [{"op": "all_reduce", "backend": "tpcomm_line", "dtype": "bfloat16", "mode": "graph", "correct": True,
             "bytes_per_rank": n, "median_us": t} for n, t in ((64, 3.0), (256 * 1024, 5.5), (1 * MiB, 15.0))]
    rows.append(dict(rows[1], median_us=1.0, correct=False))  # a wrong row is no measurement
    measured = scaling.times(rows, "line")
    assert measured == {64: 3.0, 256 * 1024: 5.5, 1 * MiB: 15.0}
    latency, gbps = scaling.fit(measured, "line", 4)
    assert latency == 3.0
    assert scaling.predict(latency, gbps, "line", 1 * MiB, 4) == pytest.approx(15.0, rel=1e-12)
    assert gbps == pytest.approx(3 * MiB * 128 / 112 / 12.0 / 1e3, rel=1e-12)
    predicted = scaling.predict(latency, gbps, "line", 256 * 1024, 4)
    assert scaling.worst_error(measured, "line", 4, 1024) == pytest.approx(abs(predicted - 5.5) / 5.5, rel=1e-12)


def test_two_shot_pays_sooner_the_more_ranks():
    assert scaling.two_shot_pays_from(2, 300, 1.0) == float("inf")  # it sends as much as line on two ranks
    at = [scaling.two_shot_pays_from(n, 300, 1.0) for n in (3, 4, 8)]
    assert at == sorted(at, reverse=True)
    n = at[1]  # at 4 ranks, the bytes saved take exactly the hop
    saved = scaling.egress_bytes("line", n, 4) - scaling.egress_bytes("two_shot", n, 4)
    assert saved / (300 * 1e3) == pytest.approx(1.0, rel=1e-12)
