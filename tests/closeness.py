"""How close FORGE's fp32 weights must be to torch.optim's: one rule for every test that trains
the same loop with both.

The loops differ in the order of fp32 sums (dW over tokens in tiles or token segments, against
torch's GEMM; the gradient norm of clip_grad_norm_ in another grouping). Normalizing rules (the
Adam family, RMSprop, Adagrad) divide each element's gradient by its own running scale, so an
element whose gradient is a cancellation (O(1) terms summing to near zero) has an O(1) relative
rounding error in ANY summation order and moves its weight by up to lr times that. So the rule
bounds each run's distance to the same loop run in float64 (ref64), by the distance that fp32
rounding alone gives torch.optim's own runs:

    |ours - ref64| <= K * E + 1e-7 + 1e-5 * |ref64|      (elementwise, E per tensor)

E is the largest distance to ref64 over the tensor, taken over torch.optim's fp32 runs: the
loop as given (ref) and the loop on its batches with the rows reversed (reversed_rows: the
same losses, each a mean over the same rows, summed in another order), and any other fp32 run
of torch's passed in `also` (a compiled one). 1e-7 is about an fp32 ulp at the weights' scale
(~1), the floor for a tensor that rounding left in place; 1e-5 is assert_close's fp32 rtol.
ref64 holds float64 weights, states and inputs; what a model itself computes in fp32 (the
RMSNorm, rotary embedding and loss of transformers' Llama) stays fp32 in it, which adds to E
alike for every fp32 run. E is one number per tensor: a packed tensor (nn.MultiheadAttention's
in_proj_bias) is bounded by its least exact part's error.

Why two torch runs and K = 16 (benchmarks/closeness_sweep.py; its output for each loop below,
every test's data generators seeded 0..1999 unless said, is in
benchmarks/results/closeness/): one ill-conditioned element dominates a tensor's largest
error, and whether a given run's rounding lands near the float64 value there is luck.
- Against torch's run alone, FORGE needed K up to 22.9 (the accelerate loop, seeds 0..7999),
  and torch's own reversed-rows run, measured the same way against torch's run, up to 134:
  the tail belongs to fp32 rounding, not to FORGE.
- Against the larger error of torch's two runs, the largest K needed was 8.65 (the GradScaler
  loop, 1 run of 2000 above 8), then 5.46 (accelerate, 2 runs of 8000 above 3.5) and 4.95
  (compile, seeds 0..917); every other loop measured (drop-in, segments, Trainer, Llama
  compiled, all 14 optimizer parity configurations; 143 to 2000 seeds each) stayed at or
  below 3.4. A second order of rows is a weak second sample where the worst element sits: an
  embedding row whose token occurs once or twice sums its terms alike in any row order (a + b
  is b + a), so torch's two runs share their error there. Hence a K twice the largest seen.
- A defect needs far more (tests/test_closeness.py, 2000 seeds each, smallest K needed): an
  lr 0.1% off 54.2, a weight decay 5% off 64.8, beta1 0.89 instead of 0.9 355.
"""
import torch

K = 16.0
FLOOR, RTOL = 1e-7, 1e-5  # see above


def assert_fp32_close(ours, ref, ref64, also=()):
    """ours, ref, ref64 and each of `also`: modules of the same structure; ours trained by
    FORGE, ref by torch.optim in fp32, ref64 the same loop in float64."""
    runs = [ref, *also]
    for (name, a), c, *bs in zip(ours.named_parameters(), ref64.parameters(),
                                 *(m.parameters() for m in runs), strict=True):
        c = c.detach().double()
        err = max(float((b.detach().double() - c).abs().max()) for b in bs)
        torch.testing.assert_close(a.detach().double(), c, rtol=RTOL, atol=K * err + FLOOR,
                                   msg=lambda m: f"{name}: {m}")


def reversed_rows(data):
    """data (a tensor, or lists of them) with each tensor's first axis reversed: the batch of a
    second torch.optim fp32 run whose losses are the same means over the same rows, summed in
    another order. Its error against float64 is a second sample of fp32 rounding's."""
    if torch.is_tensor(data):
        return data.flip(0)
    return [reversed_rows(d) for d in data]
