"""Per-expert quantized bundles: the format, the HQQ and GPTQ backends, and the quantize stage.

    from moetool.quant import QuantizeConfig, quantize, Bundle
    bundle = quantize(QuantizeConfig(model="path/to/ckpt", out=Path("out/bundle")))
    ob = Bundle.open(Path("out/bundle"), verify="full")
"""

from moetool.quant.bundle import Bundle, Entry, OpenBundle, Shard
from moetool.quant.format import Bits, Layout, dequantize, dequantize_into, encode, make_layout
from moetool.quant.quantize import Progress, QuantizeConfig, quantize

__all__ = ["Bits", "Bundle", "Entry", "Layout", "OpenBundle", "Progress", "QuantizeConfig", "Shard", "dequantize",
           "dequantize_into", "encode", "make_layout", "quantize"]
