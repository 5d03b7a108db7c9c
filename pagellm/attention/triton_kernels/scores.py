"""Score transforms shared by the attention kernels (AttentionOptions' logit soft cap)."""
from __future__ import annotations

import triton
import triton.language as tl

# The kernels keep scores in log2 units; a sink (a natural-log logit) is taken into them with this.
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def tanh(x):
    """tanh by Eigen's float rational approximation (a few ulp; +-1 past |x| = 7.9), the same as the
    C++ kernel's: the interpreter has no tanh, and this one is exact enough everywhere."""
    x = tl.minimum(tl.maximum(x, -7.90531110763549805), 7.90531110763549805)
    x2 = x * x
    num = -2.76076847742355e-16
    num = num * x2 + 2.00018790482477e-13
    num = num * x2 + -8.60467152213735e-11
    num = num * x2 + 5.12229709037114e-08
    num = num * x2 + 1.48572235717979e-05
    num = num * x2 + 6.37261928875436e-04
    num = num * x2 + 4.89352455891786e-03
    den = 1.19825839466702e-06
    den = den * x2 + 1.18534705686654e-04
    den = den * x2 + 2.26843463243900e-03
    den = den * x2 + 4.89352518554385e-03
    return x * num / den


@triton.jit
def soft_cap(s, cap):
    """``cap * tanh(s / cap)``; the kernels keep scores in log2 units, and the cap with them."""
    return cap * tanh(s / cap)
