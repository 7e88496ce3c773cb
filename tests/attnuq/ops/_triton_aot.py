"""Compile the Triton kernels ahead of time for a Hopper GPU (sm_90), without a GPU.

Run as a script in a process where ``TRITON_INTERPRET`` is unset (the interpreter replaces
``triton.jit`` functions, so nothing could be compiled): ``python tests/ops/_triton_aot.py``.
Each variant goes through triton's whole pipeline down to a cubin with the bundled ``ptxas``,
which catches what the interpreter does not check (types, layouts, register allocation). Prints
one line per variant with its registers and stack (spill) bytes; exits 1 on the first failure.
Used by ``tests/ops/test_triton.py::test_triton_kernels_compile_for_sm90``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

ROOT = Path(__file__).resolve().parents[3]


def _load_kernels():  # type: ignore[no-untyped-def]
    path = ROOT / "src" / "attnuq" / "ops" / "_triton_kernels.py"
    spec = importlib.util.spec_from_file_location("_attnuq_triton_kernels_aot", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _usage(cubin: bytes) -> str:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True,
            check=False,
        ).stdout
    for line in out.splitlines():
        if "REG:" in line:
            fields = dict(tok.split(":", 1) for tok in line.split() if ":" in tok)
            return f"REG {fields.get('REG')} STACK {fields.get('STACK')}"
    return "usage unknown"


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET to compile", file=sys.stderr)
        return 2
    k = _load_kernels()
    target = GPUTarget("cuda", 90, 32)
    ints = ("M", "LQ", "LK", "D", "DV", "HK", "NU", "H")
    strides = ("sqg", "sqm", "sqd", "skg", "skn", "skd", "svg", "svn", "svd",
               "smn", "smh", "smr", "sml", "smk", "sqb", "sqh", "skb", "skh", "svb", "svh",
               "sbb", "sbn")  # fmt: skip
    variants = []
    for dt, mask in (("bf16", "*u8"), ("fp32", "*fp32")):
        prec = "ieee" if dt == "fp32" else "tf32"
        common = {"HAS_MASK": True, "MASK_BOOL": mask == "*u8", "CAUSAL": True, "PREC": prec,
                  "UPCAST": False, "BLOCK_N": 32, "BLOCK_D": 64}
        ptrs = {"Q": "*" + dt, "K": "*" + dt, "V": "*" + dt, "MASK": mask, "SEED": "*i64",
                "IDX": "*i32", "EMPTY": "*i8", "VBAR": "*fp32", "MEAN": "*" + dt,
                "VAR": "*" + dt}
        variants.append((k.sample_kernel, ptrs, {**common, "BLOCK_M": 64, "NU_B": 4}))
        bm = 32 if dt == "fp32" else 64
        variants.append((k.moments_kernel, ptrs, {**common, "BLOCK_M": bm, "BLOCK_DV": 64}))
        variants.append((k.gather_mean_kernel, {**ptrs, "OUT": "*" + dt},
                         {"BLOCK_M": 32, "BLOCK_DV": 64}))
    lse_ptrs = {"Q": "*fp32", "K": "*fp32", "V": "*fp32", "BIAS": "*fp32", "OUT": "*fp32",
                "LSE": "*fp32"}
    variants.append((k.flash_lse_kernel, lse_ptrs, {"UPCAST": False, "BLOCK_M": 32,
                                                    "BLOCK_N": 32, "BLOCK_D": 16,
                                                    "BLOCK_DV": 16}))
    for fn, ptrs, consts in variants:
        sig = {}
        for name in fn.arg_names:
            if name in consts:
                sig[name] = "constexpr"
            elif name in ptrs:
                sig[name] = ptrs[name]
            elif name in ints or name in strides:
                sig[name] = "i32"
            else:  # scale, inv_nu
                sig[name] = "fp32"
        try:
            ck = triton.compile(ASTSource(fn, sig, constexprs=consts), target=target,
                                options={"num_warps": 8})
        except Exception as exc:
            print(f"FAILED {fn.__name__} {ptrs['Q']}: {type(exc).__name__}: {exc}")
            return 1
        print(f"ok {fn.__name__} q={ptrs['Q']} {_usage(ck.asm['cubin'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
