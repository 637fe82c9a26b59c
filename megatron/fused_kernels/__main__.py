"""`python -m megatron.fused_kernels`: build the extension into the cache now (used by make/CI)."""
import sys
import time

from megatron import fused_kernels

t0 = time.time()
ok = fused_kernels.load(verbose="-v" in sys.argv)
if ok:
    print(f"megatron fused kernels ready ({fused_kernels.build_key(fused_kernels._with_cuda())}, "
          f"{time.time() - t0:.1f}s) in {fused_kernels.cache_dir()}")
else:
    print(f"megatron fused kernels NOT built: {fused_kernels.unavailable_reason()}")
sys.exit(0 if ok or "--allow-fallback" in sys.argv else 1)
