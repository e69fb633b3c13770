"""What the recorded process-wide state keys mean: the vocabulary capture writes and diagnosis reads, defined once.

    flag_label("cudnn.deterministic") -> "`torch.backends.cudnn.deterministic`"
    flag_value({}, "cuda.matmul.allow_tf32") -> False        (a backend flag a pass did not write was at its usual value)
    "sdp_backends" in KERNEL_FLAGS -> True                    (a flag that chooses kernels)

Works on key names alone (no torch): capture/state.py reads the flags, the diagnosis names them.
"""

from __future__ import annotations

from typing import Any

# The backend flags that choose kernels (TF32 matmuls and convolutions, cuDNN's algorithm choice, reduced-precision
# reductions on a GPU; oneDNN's kernels on a CPU), readable on any build: key (its name under torch.backends) ->
# (torch's own getter in torch._C, its usual value). A pass writes a flag only where it is not at its usual value, so
# a pass record stays small.
BACKEND_FLAGS = {
    "cuda.matmul.allow_tf32": ("_get_cublas_allow_tf32", False),
    "cuda.matmul.allow_bf16_reduced_precision_reduction": ("_get_cublas_allow_bf16_reduced_precision_reduction", True),
    "cuda.matmul.allow_fp16_reduced_precision_reduction": ("_get_cublas_allow_fp16_reduced_precision_reduction", True),
    "cudnn.allow_tf32": ("_get_cudnn_allow_tf32", True),
    "cudnn.benchmark": ("_get_cudnn_benchmark", False),
    "cudnn.deterministic": ("_get_cudnn_deterministic", False),
    "cudnn.enabled": ("_get_cudnn_enabled", True),
    "mkldnn.enabled": ("_get_mkldnn_enabled", True),  # (CPU: oneDNN's convolutions and matmuls, or ATen's own)
    "mkldnn.deterministic": ("_get_mkldnn_deterministic", False),
}
USUAL = {key: usual for key, (_, usual) in BACKEND_FLAGS.items()}

# Flags that choose kernels: where one differs between a region's forward and its recompute, the recompute may
# compute other values on another device even when it did not on this one (a CPU ignores the GPU's flags)
KERNEL_FLAGS = frozenset({"deterministic", "matmul_precision", "sdp_backends", "num_threads", *BACKEND_FLAGS})

# What one pass notes about itself, not state to compare: the user's saved-tensor hooks checkpoint kept the inputs
# through (the forward's), whether the recompute got the forward's input tensors back or copies (the recompute's), the
# tensors a reentrant forward handed out other than through its outputs (the forward's), those a non-reentrant one's
# script keeps (the forward's), the outputs a reentrant recompute returned that require grad (the recompute's), the
# backward pass that ran the recompute (the recompute's), how many of a reentrant region's parameters require grad
# (`trainable` says which).
PASS_NOTES = frozenset({"saved_hooks", "inputs_kept_as", "side_outputs", "held_outputs", "grad_outputs", "backward",
                        "trainable_n"})

_LABELS = {
    "deterministic": "the deterministic-algorithms flag (`torch.use_deterministic_algorithms`)",
    "matmul_precision": "the float32 matmul precision (`torch.set_float32_matmul_precision`: TF32 matmuls on a GPU, "
                        "where `torch.backends.cuda.matmul.allow_tf32` sets it too; oneDNN's bf16 matmuls on a CPU "
                        "that has them)",
    "sdp_backends": "the SDPA backend choice (`torch.nn.attention.sdpa_kernel`, `torch.backends.cuda.enable_*_sdp`)",
    "default_dtype": "the default dtype (`torch.set_default_dtype`)",
    "num_threads": "the number of CPU threads (`torch.set_num_threads`)",
    "grad_enabled": "grad mode (`torch.is_grad_enabled()`)",
    "training": "the modules' mode (`train()` / `eval()`)",
    "arguments": "the region's list and dict arguments (what each held)",
}


def flag_label(key: str) -> str:
    """A state key as reports name it: "`torch.backends.cudnn.deterministic`", "the SDPA backends enabled (...)"."""
    return f"`torch.backends.{key}`" if key in BACKEND_FLAGS else _LABELS.get(key, f"`{key}`")


def first_flag(keys) -> str:
    """The one of several differing state keys a report names: a setting scripts make themselves (the float32 matmul
    precision) before a backend flag set with it (`cuda.matmul.allow_tf32` reads "high" where TF32 is allowed, and
    the reverse), then by name."""
    return min(keys, key=lambda k: (k in BACKEND_FLAGS, k))


def flag_value(state: dict[str, Any], key: str) -> Any:
    """A state key's value in a pass: a backend flag the pass did not write was at its usual value."""
    return state.get(key, USUAL.get(key))
