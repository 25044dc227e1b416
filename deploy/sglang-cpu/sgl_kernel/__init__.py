"""A placeholder for sgl_kernel on machines without CUDA (`make venv-sglang` puts it on the path).

SGLang's CPU path imports names from sgl_kernel when it starts, and calls them only when the
processor has AMX and sgl_kernel registered its torch operators (sglang.srt.utils.cpu_has_amx_support
checks torch.ops.sgl_kernel.convert_weight_packed). This registers none, so SGLang takes its non-AMX
path on every processor, with or without AMX; a kernel called anyway raises, naming it.
"""


def __getattr__(name: str):
    def unavailable(*args, **kwargs):
        raise RuntimeError(f"sgl_kernel.{name} was called, but this environment has only rlsync's placeholder "
                           "for SGLang's CUDA kernels (deploy/sglang-cpu): SGLang should have taken its non-AMX path")

    return unavailable
