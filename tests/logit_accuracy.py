"""Whether a bf16 run's logits are as accurate as plain torch's bf16 run of
the same model, judged against an fp32 run of the same weights: the
criterion of the transformers family tests where tpcomm's fused op rounds
differently from the model's code (tests/gpu/test_hf_families_gpu.py,
and tests/hf_families.py's bf16 runs on CPU ranks).

Plain torch's bf16 run is one bf16 evaluation of the model; tpcomm's runs
are others that round no more often (the fused op keeps the sum, the
residual add and the norms in fp32 and rounds each output once), so their
errors are of the same size or smaller, but not the same bits: where two
logits lie within a rounding error of each other, the greedy token of
either bf16 run is a coin toss. Required:
  - RMS over all logits of (run - fp32) <= FACTOR * that of plain torch's
    bf16 run. An RMS over many logits varies by well under 2x between two
    evaluations with rounding errors of one size; a wrong weight, weight
    offset or a missing residual moves the logits by O(their spread),
    orders of magnitude beyond the bound.
  - the greedy token is fp32's wherever fp32's top-2 margin exceeds
    2 * FACTOR * plain torch's largest logit error (a run within FACTOR
    times that error at every logit cannot reorder those two); such
    positions must exist.
"""
import torch

FACTOR = 2.0


def _rms(d):
    return d.float().pow(2).mean().sqrt().item()


def failures(what, logits, torch_low, ref32):
    """The criterion's failures (see the module's doc) for `logits`, given
    plain torch's low-precision logits and the fp32 run's: messages, none
    when it holds."""
    logits, torch_low, ref32 = logits.float(), torch_low.float(), ref32.float()
    err, torch_err = _rms(logits - ref32), _rms(torch_low - ref32)
    if err > FACTOR * torch_err:
        return [f"{what}: RMS logit error vs fp32 {err:.3g} > {FACTOR} x plain torch's {torch_err:.3g}"]
    bound = FACTOR * (torch_low - ref32).abs().max().item()
    top = ref32.topk(2, dim=-1)
    decisive = (top.values[..., 0] - top.values[..., 1]) > 2 * bound
    if not decisive.any():
        return [f"{what}: no position's fp32 top-2 margin exceeds {2 * bound:.3g}: the token check is empty"]
    got, want = logits.argmax(-1)[decisive], top.indices[..., 0][decisive]
    if not torch.equal(got, want):
        return [f"{what}: greedy tokens differ from fp32's at positions whose margin exceeds {2 * bound:.3g}: "
                f"{got.tolist()} vs {want.tolist()}"]
    return []
