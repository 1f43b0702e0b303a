"""Defaults several layers share, defined once (a leaf module: it imports nothing of moetool)."""

DEFAULT_HW = "rtx3090"  # the sim clock's machine: the consumer GPU the papers offload on
DEFAULT_BUDGET = "25%"  # expert cache = a quarter of the bf16 experts: every policy must offload
DTYPES = ("float32", "bfloat16", "float16")  # compute dtypes; `auto` picks one per device
CLOCKS = ("wall", "sim")  # measured, or modelled on a hardware profile
