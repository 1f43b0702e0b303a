import os

# torch.compile's inductor compiles in the test's own process, not in a pool of workers: a fork of a
# process holding threads and locks (xdist, OpenMP, the engine's) can hang in its child, and one did.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tiny import save_tiny

# Tiny models gain nothing from intra-op threads, and OpenMP spin-waits make them crawl when the
# machine's other core is busy.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """Build (once per session) and return the path of a tiny checkpoint of an architecture."""
    cache: dict[str, object] = {}

    def make(arch: str = "qwen2_moe"):
        if arch not in cache:
            cache[arch] = save_tiny(arch, tmp_path_factory.mktemp(arch))
        return cache[arch]

    return make



@pytest.fixture(scope="session")
def bundle(tiny_ckpt, tmp_path_factory):
    """A bundle of the tiny qwen2_moe at bits 16, 4 and 2 (group size 16), quantized once per session."""
    from moetool.quant.quantize import QuantizeConfig, quantize

    out = tmp_path_factory.mktemp("bundle") / "b"
    quantize(QuantizeConfig(model=str(tiny_ckpt("qwen2_moe")), out=out, bits=(16, 4, 2), group_size=16,
                            dtype="float32"))
    return out


@pytest.fixture(scope="session")
def char_ckpt(tmp_path_factory):
    """A tiny qwen2_moe checkpoint (2 MoE layers of 4 experts) that ships a character tokenizer."""
    from helpers import save_char_tokenizer

    out = tmp_path_factory.mktemp("char_ckpt") / "m"
    save_tiny("qwen2_moe", out)
    save_char_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def char_bundle(char_ckpt, tmp_path_factory):
    """A bundle of `char_ckpt` at 16 and 4 bits (round to nearest), quantized once per session."""
    from moetool.quant.quantize import QuantizeConfig, quantize

    out = tmp_path_factory.mktemp("char_bundle") / "b"
    quantize(QuantizeConfig(model=str(char_ckpt), out=out, bits=(16, 4), group_size=16, dtype="float32",
                            hqq_optimize=False))
    return out
