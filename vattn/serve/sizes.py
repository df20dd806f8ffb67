"""Byte counts as people write them: "1073741824", "512MiB", "2GiB", "1.5GB"."""
import argparse
import re

SIZES = {"": 1, "b": 1, "kib": 2**10, "kb": 10**3, "k": 2**10, "mib": 2**20, "mb": 10**6, "m": 2**20,
         "gib": 2**30, "gb": 10**9, "g": 2**30}


def byte_size(text: str) -> int:
    """Bytes from "1073741824", "60e9", "512MiB", "2GiB" or "1.5GB"; at least one."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?(?:e\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match[2].lower() not in SIZES:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: bytes, or a number with KiB, MiB, GiB, KB, MB, GB")
    size = int(float(match[1]) * SIZES[match[2].lower()])
    if size < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: it must be at least one byte")
    return size
