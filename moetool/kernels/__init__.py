"""Device kernels the engine runs on CUDA (Triton), apart from `quant`, which stays torch-only: Triton
is an optional dependency here (it ships with CUDA builds of torch), imported only when a kernel runs.

    from moetool.kernels import SlotPool, activation_of, experts_forward, supported
"""

from moetool.kernels.activation import Act, Activation, activation_of
from moetool.kernels.experts import SlotPool, experts_forward, supported

__all__ = ["Act", "Activation", "SlotPool", "activation_of", "experts_forward", "supported"]
