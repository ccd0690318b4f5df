"""Triton kernels for the paged KV cache. Importing this package imports triton."""

from batchgen.engine.kernels.kv_write import write_kv
from batchgen.engine.kernels.paged_decode import paged_decode, plan_decode_splits
from batchgen.engine.kernels.paged_prefill import paged_prefill
from batchgen.engine.kernels.rotary import rope_write_kv

__all__ = ["paged_decode", "paged_prefill", "plan_decode_splits", "rope_write_kv", "write_kv"]
