"""Which engines serve a block-FP8 model where: vLLM's and SGLang's CPU paths run FP8 block GEMMs only on
AMX tiles (vLLM 0.32: "CPUFp8W8A8BlockScaledMMKernel requires AMX tile support"; SGLang 0.5: "Fp8LinearMethod
on CPU requires that CPU has AMX support"), and otherwise fail deep in their start with a traceback. A
replica refuses such a start at once, in one line that says why and what serves it instead."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from rlsync.checks import StartupError
from rlsync.quant.fp8_format import fp8_format, is_fp8_config, quantization_config
from rlsync.rollout.engines.checkpoint import checkpoint_tensors
from rlsync.transfer.v1 import transfer_pb2 as pb

NEEDS_AMX = {"vllm": "vLLM's CPU FP8 block kernel (CPUFp8W8A8BlockScaledMMKernel)",
             "sglang": "SGLang's CPU Fp8LinearMethod"}


def checkpoint_format(model: str) -> pb.WeightFormat | None:
    """How a pre-quantized checkpoint holds its weights (the engine loads them so: vLLM, SGLang), from its
    config and tensor names alone (a weight is FP8 where the checkpoint has its scales); None when unquantized."""
    quant = quantization_config(model)
    if not is_fp8_config(quant):
        return None
    tensors = checkpoint_tensors(model)
    linears = [n for n, (shape, _) in tensors.items() if n.endswith(".weight") and len(shape) == 2]
    return fp8_format(quant, linears, tensors)


def cpu_has_amx(cpuinfo: str = "/proc/cpuinfo") -> bool:
    try:
        return "amx_tile" in Path(cpuinfo).read_text()
    except OSError:
        return False


def refuse_fp8_on_cpu(engine: str, model: str, on_cpu: bool | Callable[[], bool], amx: bool | None = None) -> None:
    """Raises StartupError when `engine` cannot serve `model`'s FP8 weights on this CPU. `on_cpu` may be asked
    lazily: only for an FP8 model (asking CUDA in a process vLLM then forks breaks its engine's start)."""
    if engine not in NEEDS_AMX or not is_fp8_config(quantization_config(model)):
        return
    if not (on_cpu() if callable(on_cpu) else on_cpu):
        return
    if amx if amx is not None else cpu_has_amx():
        return
    raise StartupError(f"{engine} cannot serve the FP8 model {model} on this CPU: {NEEDS_AMX[engine]} needs AMX "
                       "tiles, which this processor lacks (no amx_tile in /proc/cpuinfo); serve it with --engine hf "
                       "(dequantized per block on CPU), or on a GPU")
