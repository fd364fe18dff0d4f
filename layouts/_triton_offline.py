"""Compile one of our Triton kernels without a GPU, as a launch with given arguments would.

The suite interprets the kernels (``TRITON_INTERPRET=1``); what only a compiled kernel has (inline
PTX, the GPU's own FP8 conversion, register counts, SASS) is checked by compiling them for a
``triton.backends.compiler.GPUTarget`` on the CPU: Triton's own ptxas and LLVM run, no device is
needed. Each kernel module's ``compile_offline`` builds its launch's arguments from its plan and
calls :func:`compile_like_launch`.
"""

from __future__ import annotations

__all__ = ["compile_like_launch"]


def compile_like_launch(kernel, target, args: dict, constexprs: dict, num_warps: int):
    """Compile the ``@triton.jit`` ``kernel`` for ``target`` as Triton's launcher would for these
    arguments, specialised the same way: ``args`` maps each runtime argument's name to a pointer
    type (``"*bf16"``, ``"*i32"``...: a 16-byte aligned tensor, as torch allocates them), ``None``
    (an absent tensor: a constant), an ``int`` (1 becomes a constant, multiples of 16 are marked
    divisible by 16) or a ``float``; ``constexprs`` are the kernel's ``tl.constexpr`` arguments.
    Returns Triton's compiled kernel (``.asm``: "ptx", "cubin", "amdgcn", "hsaco", ...).

    Needs the kernel's module imported without ``TRITON_INTERPRET`` (a jitted function, not an
    interpreted one)."""
    import triton
    from triton.compiler import ASTSource

    names = list(kernel.arg_names)
    missing = set(names) - set(args) - set(constexprs)
    if missing:
        raise ValueError(f"no value for {', '.join(sorted(missing))}")
    signature, consts, attrs = {}, dict(constexprs), {}
    for n, v in args.items():
        if v is None or (isinstance(v, int) and not isinstance(v, bool) and v == 1):
            consts[n] = v
        elif isinstance(v, str):
            signature[n] = v
            attrs[(names.index(n),)] = [["tt.divisibility", 16]]
        elif isinstance(v, int):
            signature[n] = "i32"
            if v % 16 == 0:
                attrs[(names.index(n),)] = [["tt.divisibility", 16]]
        else:
            signature[n] = "fp32"
    signature.update({n: "constexpr" for n in consts})
    src = ASTSource(kernel, signature, constexprs={(names.index(n),): v for n, v in consts.items()}, attrs=attrs)
    return triton.compile(src, target=target, options={"num_warps": num_warps})
