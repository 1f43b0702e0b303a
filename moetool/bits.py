"""The precisions an expert is stored at, named once for the quantizer, the bundle and the artifacts
that record them (a profile's expert sizes), without torch.

    Bits.parse("4") is Bits.INT4
"""

from __future__ import annotations

from enum import IntEnum

from moetool.errors import MoetoolError


class Bits(IntEnum):
    """Stored precisions. 0 bits (skip the expert) is a policy decision and never stored."""

    BF16 = 16
    INT8 = 8
    INT4 = 4
    INT2 = 2

    @classmethod
    def parse(cls, value: int | float | str) -> "Bits":
        try:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return cls(int(value))
        except ValueError:
            choices = ", ".join(str(int(b)) for b in cls)
            raise MoetoolError(f"{value} is not a stored precision; choose bits from {choices}.") from None
