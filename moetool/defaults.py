"""Defaults several layers share, defined once (a leaf module: it imports nothing of moetool)."""

DEFAULT_HW = "rtx3090"  # the sim clock's machine: the consumer GPU the papers offload on
DEFAULT_BUDGET = "25%"  # expert cache = a quarter of the 16-bit experts: every policy must offload
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")  # `--dtype` choices; `auto` picks one per device
CLOCKS = ("wall", "sim")  # measured, or modelled on a hardware profile
# The engine's compute paths, by the transformers kernel each matches bit for bit: grouped GEMMs over
# the slot pools (transformers' default), or one expert at a time (its eager loop).
EXPERTS_IMPLS = ("grouped_mm", "eager")
# The decode paths of `run`: the captured step (one compiled program, a CUDA graph on a GPU), the
# host-driven engine, or `auto`, the one measured faster on the device (`engine.decode.choose_path`).
DECODE_PATHS = ("auto", "captured", "host")
