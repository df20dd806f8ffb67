"""The dtype a model is served in, from the `dtype` setting vLLM and
transformers share: "auto" (the checkpoint's declared dtype), "float32",
"bfloat16" or "float16" (or such a `torch.dtype`).

On the host float16 is served as bfloat16: the CPU kernels take float32 and
bfloat16, and bfloat16 keeps float32's range.  "auto" serves a 16-bit
checkpoint in float32 on a CPU without bfloat16 instructions (neither
AVX512-BF16 nor AMX-BF16): there torch's bfloat16 GEMMs run several times
slower than its float32 ones (15 against 88 GFLOP/s at 256 rows on an AVX2
EPYC), so bfloat16 would halve the memory and lose the race.  An explicit
dtype is served as asked (float16 on the host aside).
"""
import logging
from functools import cache

import torch

SETTINGS = {"auto": None, "float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
            "float16": torch.float16, "half": torch.float16}

log = logging.getLogger("vattn")


def check(setting) -> None:
    """Refuse a dtype setting that is not one of `SETTINGS` (or its torch dtype)."""
    if not (setting in SETTINGS if isinstance(setting, str) else
            isinstance(setting, torch.dtype) and setting in SETTINGS.values()):
        raise ValueError(f"dtype {setting!r}: one of {', '.join(SETTINGS)}")


@cache
def cpu_bf16() -> tuple[str, ...]:
    """This CPU's bfloat16 instructions, of "amx_bf16" and "avx512_bf16" (none: empty)."""
    return tuple(name for name, has in (("amx_bf16", torch.cpu._is_amx_tile_supported()),
                                        ("avx512_bf16", torch.cpu._is_avx512_bf16_supported())) if has)


def choose(setting, declared: torch.dtype | None, device: str = "cpu") -> tuple[torch.dtype, str]:
    """(the dtype served, why) for `setting` and a checkpoint that declares
    `declared` (None: float32) on `device`'s type."""
    check(setting)
    asked = SETTINGS.get(setting, setting)
    dtype = asked or declared or torch.float32
    why = f"asked for {_name(dtype)}" if asked else f"the checkpoint's declared {_name(dtype)}"
    if device == "cpu" and dtype == torch.float16:
        dtype, why = torch.bfloat16, why + ", served as bfloat16 on the CPU"
    if device == "cpu" and asked is None and dtype == torch.bfloat16 and not cpu_bf16():
        dtype, why = torch.float32, why + ", served as float32: this CPU has neither avx512_bf16 nor amx_bf16"
    return dtype, why


def serve(setting, declared: torch.dtype | None, device: str = "cpu") -> torch.dtype:
    """`choose`'s dtype, logged where it is not the one asked for or declared."""
    dtype, why = choose(setting, declared, device)
    if dtype != (SETTINGS.get(setting, setting) or declared or torch.float32):
        log.warning("dtype %s: %s", setting if isinstance(setting, str) else _name(setting), why)
    return dtype


def check_model(setting, model: torch.nn.Module) -> None:
    """Refuse a loaded model in another dtype than `setting` serves for it ("auto": its own)."""
    if setting == "auto":
        return
    have = next(model.parameters()).dtype
    want = choose(setting, have, next(model.parameters()).device.type)[0]
    if have != want:
        raise ValueError(f"the model is {_name(have)}, and dtype={setting!r} serves {_name(want)}: load it in "
                         f"{_name(want)}, or pass dtype='auto' to serve it as it is")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
