"""The checkpoint a replica started from, read from its safetensors files: what engines that load it
themselves (vLLM, SGLang) answer for expected_tensors, memory and an audit before any update."""

from __future__ import annotations

from pathlib import Path

# safetensors' dtype names -> bytes per element
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
            "F8_E4M3": 1, "F8_E5M2": 1}


def checkpoint_tensors(model: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (shape, safetensors dtype) of every tensor, without reading the values."""
    from safetensors import safe_open

    out = {}
    for f in sorted(Path(model).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                sl = st.get_slice(name)
                out[name] = (tuple(sl.get_shape()), sl.get_dtype())
    return out


def checkpoint_checksums(model: str) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """The audit of every tensor (rlsync.transfer.audit_entry), reading them all."""
    from safetensors.torch import load_file

    from rlsync.transfer import audit_entry

    return {n: audit_entry(t) for f in sorted(Path(model).glob("*.safetensors")) for n, t in load_file(f).items()}
