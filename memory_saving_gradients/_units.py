"""Units of memory for the figures the library and the benchmark print.

Layer: foundation; imports nothing.
"""

#: Bytes in a mebibyte (2**20).  Every figure printed as "MB" by the library and
#: by ``bench/`` is in this binary unit; no decimal megabyte (10**6) is used.
MIB = 2**20
#: Bytes in a kibibyte (2**10) and a gibibyte (2**30).
KIB = 2**10
GIB = 2**30


def describe_bytes(count: float) -> str:
    """``count`` bytes for a message: in MB with two decimals, or in bytes under 0.01 MB
    (a budget of 10 bytes is not "0.00 MB")."""
    if abs(count) < 0.01 * MIB:
        return f"{count:g} bytes"
    return f"{count / MIB:.2f} MB"
