import torch

# Tiny models gain nothing from intra-op threads, and OpenMP spin-waits make them crawl when the
# machine's other core is busy (as tests/conftest.py does for the package's tests).
torch.set_num_threads(1)
